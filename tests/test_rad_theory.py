"""rad-slai.txt Theorems 1 and 2 (kvsched.theory.rad) against RAD in simulation."""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsched.cli import app
from kvsched.cost import make_cost_model
from kvsched.errors import KvschedError
from kvsched.hardware import get_gpu, get_model
from kvsched.run import Scenario, simulate
from kvsched.theory import rad as theory
from kvsched.workload import Fixed, Request, RequestType, Workload
from kvsched.workload.lengths import Empirical
from kvsched.workload.arrivals import Closed
from kvsched.workload.spec import Phase, WorkloadSpec

PAPER_MODEL = {"weight_floor": 0.0, "overhead": 0.0}      # eq. (7) alone


def tiled(**extra):
    return make_cost_model("tiled-mistral-7b-rtx-6000-ada", {**PAPER_MODEL, **extra}, get_model("mistral-7b"),
                           get_gpu("rtx-6000-ada"))


@pytest.mark.parametrize("prompt", [Fixed(512), Empirical((128, 384, 1024))])
def test_rad_reaches_theorem_1_on_a_perfectly_tiled_closed_loop(prompt):
    """Prompts in whole t_lcm chunks, fixed outputs, a closed loop that always keeps requests
    waiting: every RAD batch is optimally tiled and throughput is r / T_R. Measured as requests
    over the makespan: RAD completes requests in bursts of t_col at cycle ends, so a window
    between two arrivals (--trim) counts one burst too many or too few."""
    w = WorkloadSpec((Phase(3072, (RequestType(prompt, Fixed(65)),), arrivals=Closed(512)),), seed=4).build()
    rec = simulate(Scenario(w, model="mistral-7b", gpu="rtx-6000-ada", cost="tiled-mistral-7b-rtx-6000-ada",
                            cost_params=PAPER_MODEL, kv_capacity=400_000), "rad", {"t_col": 128, "t_lcm": 128}).records
    bound = theory.capacity(tiled(), w.prompt, w.output)
    assert len(w) / rec.finished.max() == pytest.approx(bound, rel=0.01)


def test_lengths_map_o_to_decode_iterations():
    """One request with o = 1 is all prefill: it finishes after exactly T_R = T_P, L^D = 0."""
    cm = tiled()
    w = Workload.from_requests([Request(0.0, 256, 1)])
    rec = simulate(Scenario(w, model="mistral-7b", gpu="rtx-6000-ada", cost="tiled-mistral-7b-rtx-6000-ada",
                            cost_params=PAPER_MODEL), "rad").records
    t = theory.phase_times(cm, [256], [1])
    assert t["T_D"] == 0 and rec.finished[0] == pytest.approx(t["T_R"], rel=1e-12)
    assert theory.decode_iterations([1, 5]).tolist() == [0, 4]
    with pytest.raises(KvschedError, match="at least 1"):
        theory.decode_iterations([0])


def test_phase_split_and_cycle_length():
    cm = tiled()
    prompts, outputs = np.array([128, 512, 2048]), np.array([10, 300, 2])
    t = theory.phase_times(cm, prompts, outputs)
    assert t["T_P"] == pytest.approx(np.mean([cm.prefill_time_per_request(p) for p in prompts]), rel=1e-12)
    assert t["T_P"] + t["T_D"] == pytest.approx(cm.mean_request_time(prompts, outputs - 1), rel=1e-15)
    assert theory.split_capacity(cm, prompts, outputs, 2, 1) == pytest.approx(min(2 / t["T_P"], 1 / t["T_D"]))
    # Theorem 2: n > (t_col - 1) T_max / (eps T_R), the smallest such integer
    n = theory.cycle_length(128, 2.0, 0.5, 0.1)
    assert n == 5081 and n - 1 <= 127 * 2.0 / (0.1 * 0.5) < n
    with pytest.raises(KvschedError, match="eps"):
        theory.cycle_length(128, 2.0, 0.5, 1.5)
    length = 2048 + 299
    assert theory.worst_case_time(cm, 2048, 300) == pytest.approx(
        length * cm.lin_tile_s + 32 * cm.decode_attn_token_s * length * (length + 1) / 2)


def test_rad_capacity_cli():
    r = CliRunner().invoke(app, ["theory", "rad-capacity", "--prompt-len", "fixed:512", "--output-len", "fixed:65",
                                 "--num-requests", "10", "--replicas", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["capacity"] == pytest.approx(3 / out["T_R"]) and out["best_split"] in ("1P+2D", "2P+1D")
    r = CliRunner().invoke(app, ["theory", "rad-capacity", "--prompt-len", "fixed:512", "--cost", "roofline"])
    assert r.exit_code == 2 and "tiled" in r.output
