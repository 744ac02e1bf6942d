from kvsched.cli import main

main()
