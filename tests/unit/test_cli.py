"""The command line (``zero demo | estimate | report | consolidate``): version, help, argument errors in one
line with exit code 2, memory sizes, runnable estimates, and clean output."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zero
from tests.quick import full_only_beyond
from zero import ZeroConfig, ZeroOptimizer
from zero.cli import estimate as estimate_cli
from zero.cli import report as report_cli
from zero.cli.main import build_parser, main
from zero.cli.types import memory_size
from zero.estimator.estimator import PRECISIONS, Precision
from zero.models import GPT, GPTConfig, synthetic_batch
from zero.precision import MixedPrecision
from zero.sizes import format_bytes, format_count

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
TINY = ["--vocab", "64", "--seq-len", "8", "--d-model", "32", "--layers", "2", "--heads", "2"]


def _commands() -> dict[str, argparse.ArgumentParser]:
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subparsers.choices)


def _no_launch(monkeypatch):
    """Make launching ranks (demo, report) fail the test: the errors below must come before it."""

    def launch(*args, **kwargs):
        raise AssertionError("ranks were launched")

    monkeypatch.setattr(report_cli, "launch_ranks", launch)
    monkeypatch.setattr("zero.cli.demo.launch_ranks", launch)


def _usage_error(capsys, argv: list[str]) -> str:
    """Run ``zero ARGV``, expect exit code 2 and one line on stderr (no usage block, no traceback); return it."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    return err.rstrip("\n")


# ----- 1. one version ------------------------------------------------------------------------------------


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"zero {zero.__version__}\n"


def test_the_version_is_written_in_one_place():
    """pyproject.toml reads the version from zero/version.py, and the installed distribution reports it."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "zero.version.__version__"' in pyproject
    assert not re.search(r'^version = "', pyproject.split("[project]", 1)[1].split("[", 1)[0], re.MULTILINE)
    assert importlib.metadata.version("zero-dp") == zero.__version__
    assert (ROOT / "zero" / "py.typed").exists()


# ----- 2. help on every option ---------------------------------------------------------------------------


def test_every_option_of_every_command_has_help():
    commands = _commands()
    assert set(commands) == {"demo", "estimate", "report", "consolidate"}
    for name, parser in commands.items():
        for action in parser._actions:
            label = action.option_strings[-1] if action.option_strings else action.dest
            assert action.help and action.help != argparse.SUPPRESS, f"zero {name} {label} has no help"
        text = parser.format_help()  # and --help renders it (no bad %-formatting in a help string)
        assert all(a.option_strings[-1] in text for a in parser._actions if a.option_strings)


# ----- 3. --plot without matplotlib ----------------------------------------------------------------------


def test_plot_without_matplotlib_fails_before_anything_runs(monkeypatch, capsys):
    _no_launch(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["report", "--plot", "memory.png", *TINY]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == 'zero report: --plot needs matplotlib, which is not installed: pip install "zero-dp[plot]"\n'


def test_the_plot_extra_is_declared_and_documented_where_plot_is():
    assert re.search(r'^plot = \["matplotlib"\]', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    guide = (ROOT / "docs" / "profiler.md").read_text()  # (the README links to the guides since issue 28)
    report_paragraph = guide[guide.index("`zero report --stage 3") :].split("\n\n", 1)[0]
    assert "--plot" in report_paragraph and 'pip install "zero-dp[plot]"' in report_paragraph


# ----- 4. memory sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("24", 24 * GIB), ("1.5", 3 * GIB // 2), ("24GiB", 24 * GIB), ("24 gib", 24 * GIB), ("80G", 80 * GIB),
        ("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("500MB", 500 * 10**6), ("1TiB", 2**40), ("4096B", 4096),
    ],
)
def test_memory_sizes_a_bare_number_is_gib(text, expected):
    assert memory_size(1, 2**50)(text) == expected


@pytest.mark.parametrize("text", ["24 parsecs", "", "GiB", "-1", "1e3", "inf", "nan", "24GiBs", "2 4"])
def test_memory_size_refuses_nonsense(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected a size from 1 B to 1024 TiB \(a bare number"):
        memory_size(1, 2**50)(text)


GPU_MEMORY_RANGE = "expected a size from 1 MiB to 16 TiB (a bare number is GiB; or give a unit: 24GiB, 80G (= GiB), " \
    "80GB (10^9 bytes), 512MiB)"


def test_estimate_takes_gib_and_refuses_nonsense_in_one_line(capsys):
    assert main(["estimate", "--gpu-memory", "24", "--world-size", "1", *TINY]) == 0
    assert "budget 21.6 GiB (90% of 24 GiB)" in capsys.readouterr().out
    err = _usage_error(capsys, ["estimate", "--gpu-memory", "24 parsecs", *TINY])
    assert err == f"zero estimate: error: argument --gpu-memory: {GPU_MEMORY_RANGE}, got '24 parsecs'"
    err = _usage_error(capsys, ["estimate", "--gpu-memory", "0GiB", *TINY])
    assert err == f"zero estimate: error: argument --gpu-memory: {GPU_MEMORY_RANGE}, got '0GiB'"


def test_consolidate_shard_size_takes_the_same_sizes(capsys):
    parse = build_parser().parse_args
    assert parse(["consolidate", "ckpt", "out"]).max_shard_size == 5 * 10**9  # Hugging Face's 5GB
    assert parse(["consolidate", "ckpt", "out", "--max-shard-size", "2"]).max_shard_size == 2 * GIB
    err = _usage_error(capsys, ["consolidate", "ckpt", "out", "--max-shard-size", "lots"])
    assert err.startswith("zero consolidate: error: argument --max-shard-size: expected a size from 1 KiB to 1 TiB (")
    assert err.endswith(", got 'lots'")


# ----- 5. impossible model dimensions --------------------------------------------------------------------


@pytest.mark.parametrize("command", [["estimate", "--gpu-memory", "24"], ["report"], ["demo"]])
def test_impossible_gpt_dimensions_are_one_line_errors(monkeypatch, capsys, command):
    _no_launch(monkeypatch)
    name = command[0]
    err = _usage_error(capsys, [*command, "--d-model", "1000", "--heads", "16"])
    assert err == (f"zero {name}: error: --d-model (1000) must be a multiple of --heads (16): each head gets "
                   "d_model / heads dimensions")
    ranges = {"--vocab": 2**22, "--seq-len": 2**21, "--d-model": 2**16, "--layers": 1024, "--heads": 1024}
    for flag, high in ranges.items():
        assert _usage_error(capsys, [*command, flag, "0"]) == (
            f"zero {name}: error: argument {flag}: expected a whole number from 1 to {high}, got '0'"
        )
    err = _usage_error(capsys, [*command, "--layers", "two"])
    assert err == f"zero {name}: error: argument --layers: expected a whole number from 1 to 1024, got 'two'"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["estimate", "--gpu-memory", "24", "--world-size", "0"],
         "argument --world-size: expected a whole number from 1 to 1048576, got '0'"),
        (["estimate", "--gpu-memory", "24", "--micro-batch", "4", "0"],
         "argument --micro-batch: expected a whole number from 1 to 65536, got '0'"),
        (["estimate", "--gpu-memory", "24", "--show", "-1"],
         "argument --show: expected a whole number from 1 to 10000, got '-1'"),
        (["report", "--steps", "0"], "argument --steps: expected a whole number from 1 to 1000, got '0'"),
        (["report", "--micro-batch", "0"], "argument --micro-batch: expected a whole number from 1 to 1024, got '0'"),
        (["report", "--world-size", "-2"], "argument --world-size: expected a whole number from 1 to 64, got '-2'"),
        (["demo", "--world-size", "0"], "argument --world-size: expected a whole number from 1 to 64, got '0'"),
        (["demo", "--steps", "0"], "argument --steps: expected a whole number from 1 to 100000, got '0'"),
        (["demo", "--batch", "3"], "--batch (3) must be a multiple of the world size (2), or 0 for 4 per rank"),
        (["demo", "--lr", "-1"], "argument --lr: expected a number above 0 and at most 1, got '-1'"),
    ],
)
def test_non_positive_sizes_are_one_line_errors(monkeypatch, capsys, argv, message):
    _no_launch(monkeypatch)
    monkeypatch.delenv("RANK", raising=False)
    assert _usage_error(capsys, argv) == f"zero {argv[0]}: error: {message}"


# every option that takes a number or a size, of every command, and what its command needs besides
REQUIRED = {"demo": ["demo"], "report": ["report"], "estimate": ["estimate", "--gpu-memory", "24"],
            "consolidate": ["consolidate", "ckpt", "out"]}
NUMERIC_OPTIONS = [(name, action.option_strings[-1]) for name, parser in _commands().items()
                   for action in parser._actions if action.option_strings and action.type not in (None, str)]
RANGE = re.compile(r"expected a (?:whole number|number|size) (from .+? to .+?|above .+? and at most .+?)"
                   r"(?: \(.*\))?, got ")


def test_the_numeric_options_are_those_of_every_command():
    assert {name for name, _ in NUMERIC_OPTIONS} == set(REQUIRED)
    assert ("estimate", "--gpu-memory") in NUMERIC_OPTIONS and ("consolidate", "--max-shard-size") in NUMERIC_OPTIONS


@pytest.mark.parametrize("command,flag", NUMERIC_OPTIONS)
@pytest.mark.parametrize("value", ["9" * 400, "1e30", "-1", "nan", "inf"])
def test_absurd_numbers_are_one_line_errors_naming_the_range(monkeypatch, capsys, command, flag, value):
    """A 400-digit number (once an OverflowError), 1e30 (once a torch TypeError, or accepted), a negative or not a
    number: one line naming the option and its accepted range, the range its help states; exit code 2."""
    _no_launch(monkeypatch)
    monkeypatch.delenv("RANK", raising=False)
    err = _usage_error(capsys, [*REQUIRED[command], flag, value])
    assert err.startswith(f"zero {command}: error: argument {flag}: expected a ")
    accepted = RANGE.search(err).group(1)
    (action,) = [a for a in _commands()[command]._actions if flag in a.option_strings]
    assert accepted in action.help
    assert len(err) < 300  # a long value is cut short


@pytest.mark.parametrize("value", ["1000000000000000000000000000000", "0.0000001", "1e-7", "17TiB", "1023KiB"])
def test_gpu_memory_outside_1_mib_to_16_tib_is_refused(capsys, value):
    err = _usage_error(capsys, ["estimate", "--gpu-memory", value, *TINY])
    assert err == f"zero estimate: error: argument --gpu-memory: {GPU_MEMORY_RANGE}, got {value!r}"


@pytest.mark.parametrize("command", ["demo", "report"])
def test_a_model_this_machine_cannot_train_is_refused_before_launching(monkeypatch, capsys, command):
    """zero demo and zero report train on this machine's CPU ranks: a model whose fp32 weights, gradients and Adam
    moments (16 bytes per parameter) exceed its available memory is refused in one line, not in the ranks'
    tracebacks."""
    _no_launch(monkeypatch)
    monkeypatch.setattr(report_cli, "available_host_bytes", lambda: 2**10)
    numel = sum(p.numel() for p in GPT(GPTConfig(64, 8, 32, 2, 2)).parameters())
    err = _usage_error(capsys, [command, *TINY])
    assert err == (f"zero {command}: error: a GPT of {format_count(numel)} parameters needs at least "
                   f"{format_bytes(16 * numel)} to train (16 bytes per parameter: fp32 weights, gradients and AdamW's "
                   "two moments), more than the 1 KiB this machine has available: choose a smaller --vocab, --d-model "
                   "or --layers")


def test_consolidate_refuses_an_unwritable_output_in_one_line(tmp_path, capsys):
    """An ``OSError`` (here: the output's parent is a file) is one line naming the path, exit code 2."""
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_layers=1, num_heads=2))
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=1)
    zero.save_checkpoint(tmp_path / "ckpt", model, opt, progress=False)
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "model.safetensors"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zero consolidate: ") and "a_file" in err, err
    assert "Traceback" not in err


def test_a_bad_command_line_exits_2_without_a_traceback():
    run = subprocess.run([sys.executable, "-m", "zero", "estimate", "--gpu-memory", "24", "--d-model", "1000",
                          "--heads", "16"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == ("zero estimate: error: --d-model (1000) must be a multiple of --heads (16): each head "
                          "gets d_model / heads dimensions\n")


# ----- 6. zero estimate lists only what ZeroOptimizer runs -----------------------------------------------


def test_every_precision_the_estimator_prices_is_a_mixed_precision_policy():
    assert set(estimate_cli.PRECISION_POLICIES) == set(PRECISIONS)
    for name, policy in estimate_cli.PRECISION_POLICIES.items():
        assert Precision.of(MixedPrecision(**policy), name) == PRECISIONS[name]


@pytest.mark.filterwarnings("ignore:offloaded AdamW steps on the host with its foreach kernel")
# --quick: mixed-fp32-reduce (the most a listed configuration sets: bf16 parameters, fp32 reduction); fp32 and mixed in
# the full run
@pytest.mark.parametrize("precision", full_only_beyond(sorted(PRECISIONS), ("mixed-fp32-reduce",)))
def test_every_configuration_estimate_prints_is_one_zero_optimizer_runs(capsys, precision, tmp_path):
    """What ``zero estimate`` lists (fitting and not) is a valid ZeroConfig, and ZeroOptimizer trains a step with it."""
    path = tmp_path / "plan.json"
    assert main(["estimate", "--gpu-memory", "2MiB", "--world-size", "2", "--micro-batch", "1", "4",
                 "--precision", precision, "--show", "1000", "--json", str(path), *TINY]) == 0
    out = capsys.readouterr().out
    listed = json.loads(path.read_text())
    estimates = listed["fits"] + listed["rejected"]
    printed = [e["zero_config"] for e in estimates]
    rows = re.findall(r"^  stage (\d), micro-batch (\d+)", out, re.MULTILINE)
    assert len(printed) == len(rows) == 2 * 2 * 7  # micro-batches x checkpointing x (stages 0-3 + offload at 1-3)
    assert sorted(rows) == sorted((str(e["stage"]), str(e["micro_batch"])) for e in estimates)
    assert all(e["zero_config"] == {"stage": e["stage"], **e["config"]} for e in estimates)  # what was priced
    first = re.search(r"^to run the first: ZeroOptimizer\(optimizer, model, (.*)\)$", out, re.MULTILINE)
    if listed["fits"]:
        assert eval(f"dict({first.group(1)})") == printed[0]
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_layers=2, num_heads=2)
    x, y = synthetic_batch(0, 2, cfg)
    for kwargs in {repr(k): k for k in printed}.values():
        config = ZeroConfig(**kwargs)  # pydantic: the validator ZeroOptimizer applies
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, config=config)
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(model.loss(x, y)), kwargs  # a second forward, after the step


# ----- 7, 8. clean output, plurals -----------------------------------------------------------------------


def test_estimate_output_is_grammatical(capsys):
    assert main(["estimate", "--gpu-memory", "24", "--world-size", "1", *TINY]) == 0
    out = capsys.readouterr().out
    assert ", 1 rank, budget" in out and "1 ranks" not in out
    assert main(["estimate", "--gpu-memory", "24", "--world-size", "3", *TINY]) == 0
    assert ", 3 ranks, budget" in capsys.readouterr().out


def test_profiler_chatter_is_dropped_from_the_ranks_stderr(monkeypatch, capsys):
    """Kineto's start/stop lines go; everything else the ranks write to stderr (errors) is passed on."""
    script = (
        "import sys; "
        "sys.stderr.write('USDT:2026-11-23 18:47:01 17407:17407 "
        "SyncActivityProfilerHandler.cpp:52] profiler_start\\n'); "
        "sys.stderr.write('STAGE:2026-11-23 18:47:16 17531:17531 "
        "SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\\n'); "
        "sys.stderr.write('ValueError: a real error\\n'); print('rank output'); sys.exit(3)"
    )
    real_popen = subprocess.Popen
    seen = []

    def popen(cmd, **kwargs):
        seen.append(cmd)
        return real_popen([sys.executable, "-c", script], **kwargs)

    monkeypatch.setattr(report_cli.subprocess, "Popen", popen)
    args = argparse.Namespace(world_size=1, argv=["report", "--steps", "1"])
    assert report_cli.launch_ranks(args, "report") == 3
    out, err = capsys.readouterr()
    assert out.startswith("zero report: launching 1 CPU rank with torchrun")
    assert err == "ValueError: a real error\n"
    assert seen[0][-5:] == ["-m", "zero", "report", "--steps", "1"]  # the arguments main() was given, not sys.argv


# ----- 9. the package description ------------------------------------------------------------------------


def test_description_names_all_three_stages():
    description = re.search(r'^description = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert re.search(r"stage 1[^,;]* optimizer state", description)
    assert re.search(r"stage 2[^,;]* gradients", description)
    assert re.search(r"stage 3[^,;]* parameters", description)
