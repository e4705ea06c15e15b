"""`stepscope lint` finds the planted syncs in hot functions, with file:line, and nothing else."""

from __future__ import annotations

import os

import pytest

from instrument.lint import lint_paths, lint_source, main

PLANTED = os.path.join(os.path.dirname(__file__), "planted_syncs.py")


def test_planted_findings_exact():
    found = [(f.line, f.op) for f in lint_paths([PLANTED])]
    assert found == [
        (10, ".item()"),
        (11, ".tolist()"),
        (12, ".cpu()"),
        (13, '.to("cpu")'),
        (14, ".any() as a condition"),
        (16, "bool()"),
        (17, ".numpy()"),
        (23, "torch.cuda.synchronize()"),
    ]


@pytest.mark.parametrize(
    ("source", "ops"),
    [
        ("# stepscope: hot\ndef f(e):\n    e.synchronize()\n", [".synchronize()"]),
        ("# stepscope: hot\ndef f(x):\n    return torch.nonzero(x)\n", ["torch.nonzero()"]),
        ("# stepscope: hot\ndef f(x):\n    return x.to(device='cpu')\n", ['.to("cpu")']),
        ("# stepscope: hot\ndef f(x):\n    return x.to('cuda', non_blocking=True)\n", []),
        (
            "# stepscope: hot\ndef f(x):\n    while x.all():\n        pass\n",
            [".all() as a condition"],
        ),
        ("def f(x):\n    return x.item()\n", []),  # not hot
        ("# stepscope: hot\n@staticmethod\ndef f(x):\n    return x.item()\n", [".item()"]),
        (
            "# stepscope: hot\ndef f(x):\n    def g():\n        return x.tolist()\n    return g\n",
            [".tolist()"],
        ),
    ],
)
def test_patterns(source, ops):
    assert [f.op for f in lint_source(source)] == ops


_HOT = "# stepscope: hot\ndef f(x, n):\n"


@pytest.mark.parametrize(
    ("body", "ops"),
    [
        # Host mirrors by name (STYLE.md placement suffixes): not syncs.
        ("    return s.num_computed_cpu.tolist()\n", []),
        ("    return s.lens_np[:n].tolist()\n", []),
        ("    return mask_host.any() and bool(flag_cpu)\n", []),
        ("    return out_cpu.item(), out_cpu.numpy()\n", []),
        ("    return buf_host.to('cpu')\n", []),
        # Host by annotation.
        ("    a: np.ndarray = g()\n    return a.tolist()\n", []),
        ("    b: list[int] = g()\n    return b.index(3)\n", []),
        # Device tensors (or unknown) are still caught, also beside a host one.
        ("    return s.num_computed.gpu.tolist()\n", [".tolist()"]),
        ("    return x_gpu.item()\n", [".item()"]),
        ("    return logits.cpu(), tokens_cpu.tolist()\n", [".cpu()"]),
        ("    if mask_gpu.any():\n        pass\n", [".any() as a condition"]),
        ("    a: torch.Tensor = g()\n    return a.tolist()\n", [".tolist()"]),
        ("    return cpu_tensor.tolist()\n", [".tolist()"]),  # a prefix is not the suffix
        ("    torch.cuda.synchronize()\n", ["torch.cuda.synchronize()"]),
    ],
)
def test_host_objects_are_not_syncs(body, ops):
    assert [f.op for f in lint_source(_HOT + body)] == ops


def test_project_engine_lints_clean():
    """The README's example: ``stepscope lint engine/`` exits 0 on the project's own engine."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert main([os.path.join(root, "engine")]) == 0


def test_cli_exit_codes_and_output(tmp_path, capsys):
    assert main([PLANTED]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{PLANTED}:10: .item()"
    clean = tmp_path / "clean.py"
    clean.write_text("# stepscope: hot\ndef f(x):\n    return x + 1\n")
    assert main([str(clean)]) == 0
    assert capsys.readouterr().out == ""
    assert main([str(tmp_path / "missing.py")]) == 2
    bad = tmp_path / "bad.py"
    bad.write_text("def (:\n")
    assert main([str(bad)]) == 2
    assert "cannot parse" in capsys.readouterr().err
