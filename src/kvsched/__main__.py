from kvsched.cli import app

app(prog_name="kvsched")
