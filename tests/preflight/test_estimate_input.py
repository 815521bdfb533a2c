"""%%gpumem --estimate on bad input: a size that no GPU has, and no torch installed, are one line each; a good estimate is remembered for the OOM panel."""
import subprocess
import sys
import textwrap

import pytest

from conftest import run, texts

# Each test runs at the default threshold, and the names it makes in the suite's shared shell are removed after it.
pytestmark = pytest.mark.usefixtures("default_threshold", "restore_user_ns")


@pytest.mark.parametrize("size", ["0", "-5", "0MiB", "-1.5GiB", "0.4"])
@pytest.mark.parametrize("form", ["--estimate {}", "--estimate={}"])
def test_a_size_no_gpu_has_is_a_one_line_usage_error(ip, gpumem, size, form):
    ip.user_ns["est_ran"] = 0
    result, cap = run(ip, f"%%gpumem {form.format(size)}\nest_ran += 1\n")
    assert not result.success and type(result.error_in_exec).__name__ == "UsageError"
    message = str(result.error_in_exec)
    assert "\n" not in message and "must be a positive size" in message and size in message
    assert ip.user_ns["est_ran"] == 0  # the cell did not run
    assert texts(cap) == []  # no report, no per-cell line


def test_an_unparsable_size_is_a_one_line_usage_error(ip, gpumem):
    result, _ = run(ip, "%%gpumem --estimate 16 GiBs\nx = 1\n")
    assert type(result.error_in_exec).__name__ == "UsageError" and "\n" not in str(result.error_in_exec)


@pytest.mark.slow
def test_without_torch_installed_estimate_is_one_line(tmp_path):
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # `import torch` fails as if it were not installed
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "ipy_gpumem")
        for header in ("%%gpumem --estimate T4", "%%gpumem --estimate"):
            result = ip.run_cell(header + "\\nx = 1\\n", store_history=True)
            print("RESULT", result.success, "x" in ip.user_ns)
        print("TORCH", sys.modules["torch"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    said = [line for line in lines if line.startswith("%%gpumem --estimate")]
    assert len(said) == 2 and all("needs PyTorch" in line and "pip install torch" in line for line in said)
    assert lines.count("RESULT True False") == 2  # nothing ran, no error raised
    assert "TORCH None" in lines  # nothing imported it behind the user's back
    assert "Traceback" not in out.stdout + out.stderr and "ModuleNotFoundError" not in out.stdout + out.stderr


@pytest.mark.slow
def test_an_estimate_is_remembered_for_the_oom_panel(ip, gpumem):
    pytest.importorskip("torch")
    from ipy_gpumem.preflight import known
    from ipy_gpumem.preflight.cell import CellEstimate

    known.forget()
    run(ip, "import torch\nkn_model = torch.nn.Linear(64, 64)\nkn_x = torch.randn(16, 64)")
    body = "kn_out = kn_model(kn_x)\nkn_out.sum().backward()\n"
    result, cap = run(ip, "%%gpumem --estimate T4\n" + body)
    assert result.success and any("Verdict" in t for t in texts(cap))
    remembered = known.recall(body)
    assert isinstance(remembered, CellEstimate) and remembered.estimate.peak_allocated > 0
    assert known.recall("%%gpumem --lines\n" + body) is remembered  # the real run's cell finds it
    # A cell that could not be estimated leaves nothing behind.
    run(ip, "%%gpumem --estimate T4\nkn_idx = kn_x.nonzero()\n")
    assert known.recall("kn_idx = kn_x.nonzero()\n") is None
    run(ip, "%gpumem clear")
    assert known.recall(body) is None  # forgotten with the cells
