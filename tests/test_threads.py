"""Thread defaults that hold up on a shared machine: OpenMP threads wait passively."""
import os
import subprocess
import sys


def _policy(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", "import cedlm, os; print(os.environ['OMP_WAIT_POLICY'])"],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_importing_cedlm_sets_passive_waiting_before_torch():
    assert _policy({}) == "PASSIVE"


def test_a_policy_the_user_set_is_kept():
    assert _policy({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
