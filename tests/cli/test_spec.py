"""Launch specs: grid expansion, names, overrides, and every error a user can make (exact text)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from xshare import SpecError
from xshare import jobs as specs
from xshare.cli.main import main

REPO = Path(__file__).resolve().parents[2]

# A user's own factory module, written next to the spec (the launcher puts the cwd on sys.path).
FACTORIES = '''
import time

import jax.numpy as jnp
import numpy as np
import xshare


@xshare.job
def add_step(state, batch):
    new = state + batch
    return new, {"loss": jnp.mean(new * new), "norm": jnp.sum(jnp.abs(new))}


def make(lr=0.1, width=4, seed=0, steps=10, fail_at=-1, delay=0.0):
    def data(k):
        time.sleep(delay)  # a slow input pipeline, so a test can watch a job run
        if k == fail_at:
            raise RuntimeError(f"bad batch at step {k}")
        return np.full((width,), lr, np.float32)

    return add_step.bind(np.full((width,), float(seed), np.float32), data, steps=steps)


def make_nosteps(lr=0.1):
    return add_step.bind(np.zeros(2, np.float32), lambda k: np.full(2, lr, np.float32), steps=3)


def make_kw(**kw):
    return make_nosteps()


def needs_size(size, lr=0.1):
    return make_nosteps(lr)


def not_a_job(lr=0.1):
    return {"lr": lr}


def returns_step(lr=0.1):
    return add_step


def raises(lr=0.1):
    raise ValueError("lr must be positive")


NOT_CALLABLE = 3
'''


@pytest.fixture
def fac(tmp_path, monkeypatch):
    """A uniquely named factory module in tmp_path (the cwd); yields its module name."""
    name = f"xs_fac_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def write_spec(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ------------------------------------------------------------------------------ values


@pytest.mark.parametrize(
    "text, value",
    [
        ("3", 3),  # int first
        ("-2", -2),
        ("1e-3", 0.001),  # then float
        ("0.5", 0.5),
        ("true", True),  # then bool, any case
        ("False", False),
        ("relu", "relu"),  # else the string
        ("1e-3x", "1e-3x"),
    ],
)
def test_parse_value(text, value):
    got = specs.parse_value(text)
    assert got == value and type(got) is type(value)


def test_parse_set_sweeps_comma_lists_and_keeps_scalars():
    assert specs.parse_set("lr=1e-3,3e-4") == ("lr", [0.001, 0.0003])
    assert specs.parse_set("act=gelu") == ("act", "gelu")
    with pytest.raises(SpecError, match=re.escape("--set 'lr': write --set NAME=VALUE")):
        specs.parse_set("lr")
    with pytest.raises(SpecError, match=re.escape("--set 'lr=1,': empty value")):
        specs.parse_set("lr=1,")


# ------------------------------------------------------------------------------ expansion


def test_grid_is_the_cartesian_product_named_by_swept_params(tmp_path, fac):
    path = write_spec(tmp_path, f'''
        [runtime]
        policy = "fair"
        memory = "1GiB"
        [[job]]
        entry = "{fac}:make"
        steps = 7
        params = {{ width = [4, 8], lr = [0.1, 0.2], seed = 3 }}
    ''')
    plan = specs.plan_file(path)
    assert plan.runtime == specs.RuntimeOptions(policy="fair", memory="1GiB", quantum=1)
    # params sorted by key: lr varies slowest; seed is fixed so it is not in the names
    assert [j.name for j in plan.jobs] == ["0_lr=0.1,width=4", "1_lr=0.1,width=8", "2_lr=0.2,width=4", "3_lr=0.2,width=8"]
    assert plan.jobs[1].params == {"lr": 0.1, "width": 8, "seed": 3}
    assert {j.steps for j in plan.jobs} == {7}
    assert plan.stem == "spec"


def test_replicas_pass_seeds_and_name_them(tmp_path, fac):
    path = write_spec(tmp_path, f'''
        [[job]]
        entry = "{fac}:make"
        replicas = 2
        params = {{ lr = [0.1, 0.2] }}
    ''')
    plan = specs.plan_file(path)
    assert [j.name for j in plan.jobs] == ["0_lr=0.1,seed=0", "1_lr=0.1,seed=1", "2_lr=0.2,seed=0", "3_lr=0.2,seed=1"]
    assert [j.params["seed"] for j in plan.jobs] == [0, 1, 0, 1]


def test_replicas_with_explicit_seed_are_identical_copies(tmp_path, fac):
    path = write_spec(tmp_path, f'''
        [[job]]
        entry = "{fac}:make"
        replicas = 3
        params = {{ seed = 7 }}
    ''')
    plan = specs.plan_file(path)
    assert [j.name for j in plan.jobs] == ["0_replica=0", "1_replica=1", "2_replica=2"]
    assert all(j.params == {"seed": 7} for j in plan.jobs)


def test_numbers_are_padded_to_the_width_of_the_count_across_tables(tmp_path, fac):
    path = write_spec(tmp_path, f'''
        [[job]]
        entry = "{fac}:make"
        params = {{ lr = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0] }}
        [[job]]
        entry = "{fac}:make"
        name = "base"
        [[job]]
        entry = "{fac}:make_nosteps"
    ''')
    names = [j.name for j in specs.plan_file(path).jobs]
    assert len(names) == 12
    assert names[0] == "00_lr=0.1" and names[9] == "09_lr=1.0"
    assert names[10] == "10_base"  # a table's name labels it when nothing is swept
    assert names[11] == f"11_{fac}"  # else the entry's module


def test_name_prefixes_the_swept_values_and_names_are_filesystem_safe(tmp_path, fac):
    path = write_spec(tmp_path, f'''
        [[job]]
        entry = "{fac}:make_kw"
        name = "my run/1"
        params = {{ act = ["gelu", "a b/c"], layers = [[128, 64]] }}
    ''')
    plan = specs.plan_file(path)
    assert [j.name for j in plan.jobs] == ["0_my-run-1_act=gelu", "1_my-run-1_act=a-b-c"]
    assert plan.jobs[0].params["layers"] == [128, 64]  # a list inside a list is one value, not a sweep


def test_steps_default_comes_from_the_factory_signature(tmp_path, fac):
    path = write_spec(tmp_path, f'''
        [[job]]
        entry = "{fac}:make"
        [[job]]
        entry = "{fac}:make_nosteps"
    ''')
    assert [j.steps for j in specs.plan_file(path).jobs] == [10, None]


def test_command_line_overrides_runtime_steps_replicas_and_params(tmp_path, fac):
    path = write_spec(tmp_path, f'''
        [runtime]
        policy = "pack"
        memory = "2GiB"
        quantum = 2
        [[job]]
        entry = "{fac}:make"
        steps = 100
        params = {{ lr = [0.1, 0.2], width = 4 }}
    ''')
    over = specs.Overrides(policy="srtf", memory="device", quantum=4, steps=5, replicas=2, sets={"width": [2, 3]})
    plan = specs.plan_file(path, over)
    assert plan.runtime == specs.RuntimeOptions(policy="srtf", memory=None, quantum=4)
    assert len(plan.jobs) == 8 and {j.steps for j in plan.jobs} == {5}
    assert plan.jobs[0].name == "0_lr=0.1,seed=0,width=2"


def test_entry_launch_from_flags(fac):
    over = specs.Overrides(sets=dict(map(specs.parse_set, ["lr=0.1,0.2", "width=8"])), replicas=2, steps=4)
    plan = specs.plan_entry(f"{fac}:make", over)
    assert [j.name for j in plan.jobs] == ["0_lr=0.1,seed=0", "1_lr=0.1,seed=1", "2_lr=0.2,seed=0", "3_lr=0.2,seed=1"]
    assert plan.jobs[3].params == {"lr": 0.2, "width": 8, "seed": 1}
    assert plan.runtime == specs.RuntimeOptions()
    assert plan.stem == f"{fac}-make"


def test_build_names_the_job_and_applies_steps_and_priority(tmp_path, fac):
    path = write_spec(tmp_path, f'''
        [[job]]
        entry = "{fac}:make"
        steps = 6
        priority = 3
        params = {{ lr = [0.1, 0.2] }}
        [[job]]
        entry = "{fac}:make_nosteps"
        steps = 2
    ''')
    built = specs.build_all(specs.plan_file(path))
    assert [(s.name, s.steps, s.priority) for s in built] == [("0_lr=0.1", 6, 3), ("1_lr=0.2", 6, 3), (f"2_{fac}", 2, 0)]
    assert built[1].meta["entry"] == f"{fac}:make" and built[1].meta["params"] == {"lr": 0.2}


# ------------------------------------------------------------------------------ errors

# (spec body, with {fac} for the factory module; exact substrings of the message)
SPEC_ERRORS = [
    pytest.param('[[job]]\nentry = "xs_no_such_module:make"\n',
                 ["spec.toml: [[job]] #1 (xs_no_such_module:make): no module named 'xs_no_such_module'",
                  "run from the directory that holds it"], id="unknown-module"),
    pytest.param('[[job]]\nentry = "{fac}x:make"\n',
                 ["no module named '{fac}x' (did you mean '{fac}'?)"], id="module-close-match"),
    pytest.param('[[job]]\nentry = "{fac}:mak"\n',
                 ["[[job]] #1 ({fac}:mak): module '{fac}' has no function 'mak' (did you mean 'make'"],
                 id="function-close-match"),
    pytest.param('[[job]]\nentry = "{fac}:zzzzzz"\n',
                 ["has no function 'zzzzzz'; it defines: add_step, make, make_kw, make_nosteps"], id="function-unknown"),
    pytest.param('[[job]]\nentry = "{fac}:NOT_CALLABLE"\n',
                 ["{fac}:NOT_CALLABLE is not a function (it is a int value)"], id="not-callable"),
    pytest.param('[[job]]\nentry = "{fac}.make"\n',
                 ["entry '{fac}.make' must be 'module:function' (e.g. 'xshare.models.mlp:make_job')"], id="entry-format"),
    pytest.param('[[job]]\nsteps = 5\n',
                 ["spec.toml: [[job]] #1: missing required key 'entry'; add entry = \"module:function\""], id="no-entry"),
    pytest.param('[[job]]\nentry = "{fac}:make"\n[[job]]\nentry = "{fac}:make"\nstep = 5\n',
                 ["[[job]] #2 ({fac}:make): unknown key 'step' (did you mean 'steps'?). Allowed keys: entry, steps, replicas, priority, name, params."],
                 id="unknown-job-key"),
    pytest.param('jobs = 1\n',
                 ["spec.toml: unknown top-level key 'jobs' (did you mean 'job'?). Allowed: [runtime] and [[job]] tables."],
                 id="unknown-top-key"),
    pytest.param('[runtime]\npolcy = "pack"\n[[job]]\nentry = "{fac}:make"\n',
                 ["spec.toml: [runtime]: unknown key 'polcy' (did you mean 'policy'?). Allowed keys: policy, memory, quantum, fuse."],
                 id="unknown-runtime-key"),
    pytest.param('[runtime]\npolicy = "pak"\n[[job]]\nentry = "{fac}:make"\n',
                 ["[runtime] policy 'pak' is not a policy (did you mean 'pack'?). Choose one of: fifo, pack, srtf, fair, priority."],
                 id="bad-policy"),
    pytest.param('[runtime]\nmemory = "2 GiBs"\n[[job]]\nentry = "{fac}:make"\n',
                 ["spec.toml: [runtime] memory: cannot read memory size '2 GiBs'"], id="bad-memory"),
    pytest.param('[runtime]\nquantum = 0\n[[job]]\nentry = "{fac}:make"\n',
                 ["[runtime] quantum = 0: the quantum is a whole number of steps, at least 1"], id="bad-quantum"),
    pytest.param('[[job]]\nentry = "{fac}:make"\nparams = {{ widht = 8 }}\n',
                 ["job 0_{fac} (spec.toml: [[job]] #1, {fac}:make): the factory does not accept parameter 'widht' (did you mean 'width'?). It accepts: lr, width, seed, steps, fail_at, delay."],
                 id="unknown-param"),
    pytest.param('[[job]]\nentry = "{fac}:make_nosteps"\nreplicas = 2\n',
                 ["does not accept parameter 'seed' (replicas > 1 passes seed=0..N-1; set params.seed to run identical copies instead). It accepts: lr."],
                 id="replicas-need-seed"),
    pytest.param('[[job]]\nentry = "{fac}:needs_size"\n',
                 ["the factory needs 'size'; set it under params (or with --set NAME=VALUE)"], id="missing-param"),
    pytest.param('[job]\nentry = "{fac}:make"\n',
                 ["write each job as [[job]] (an array of tables), not [job]"], id="job-not-array"),
    pytest.param('[runtime]\npolicy = "pack"\n', ["no jobs: add at least one [[job]] table"], id="no-jobs"),
    pytest.param('[[job]]\nentry = "{fac}:make"\nparams = {{ lr = [] }}\n',
                 ["params.lr is an empty list, so the grid is empty"], id="empty-sweep"),
    pytest.param('[[job]]\nentry = "{fac}:make"\nsteps = -1\n',
                 ["[[job]] #1 ({fac}:make): steps = -1 must be a whole number >= 0"], id="negative-steps"),
    pytest.param('[[job]]\nentry = "{fac}:make"\nreplicas = 0\n',
                 ["replicas = 0 must be a whole number >= 1"], id="zero-replicas"),
    pytest.param('[[job]\n', ["spec.toml: not valid TOML:"], id="toml-syntax"),
]


@pytest.mark.parametrize("body, expected", SPEC_ERRORS)
def test_spec_errors_name_the_job_the_cause_and_the_fix(tmp_path, fac, capsys, body, expected):
    write_spec(tmp_path, body.format(fac=fac))
    with pytest.raises(SpecError) as info:
        specs.plan_file("spec.toml")
    for text in expected:
        assert text.format(fac=fac) in str(info.value)
    # The command reports the same message on stderr, exits 2 and runs nothing.
    assert main(["launch", "spec.toml", "--out", "run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("xshare launch: error: ")
    assert expected[0].format(fac=fac) in err
    assert not (tmp_path / "run").exists()


# Problems found only by calling the factory: still before anything runs.
BUILD_ERRORS = [
    ("not_a_job", "job 0_{fac} (spec.toml: [[job]] #1, {fac}:not_a_job): the factory returned dict, not a bound job; "
                  "it must return step.bind(state, data, steps=...) of an @xshare.job step"),
    ("returns_step", "the factory returned the step itself; return step.bind(state, data, steps=...) instead"),
    ("raises", "job 0_{fac} (spec.toml: [[job]] #1, {fac}:raises): the factory raised ValueError: lr must be positive"),
]


@pytest.mark.parametrize("function, expected", BUILD_ERRORS)
def test_factory_errors_stop_the_launch_before_anything_runs(tmp_path, fac, capsys, function, expected):
    write_spec(tmp_path, f'[[job]]\nentry = "{fac}:make"\n[[job]]\nentry = "{fac}:{function}"\n')
    # Both tables are numbered together; the bad one is job 1. Reformat the expectation for that.
    expected = expected.format(fac=fac).replace(f"job 0_{fac} (spec.toml: [[job]] #1", f"job 1_{fac} (spec.toml: [[job]] #2")
    assert main(["launch", "spec.toml", "--out", "run"]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--policy", "lifo"], "--policy 'lifo' is not a policy (did you mean 'fifo'?). Choose one of: fifo, pack, srtf, fair, priority."),
        (["--memory", "lots"], "--memory: cannot read memory size 'lots'"),
        (["--quantum", "0"], "--quantum = 0: the quantum is a whole number of steps, at least 1"),
        (["--set", "lr"], "--set 'lr': write --set NAME=VALUE or --set NAME=V1,V2,..."),
        (["--set", "lrate=0.1"], "the factory does not accept parameter 'lrate'. It accepts: lr, width, seed, steps, fail_at, delay."),
        (["--replicas", "0"], "replicas = 0 must be a whole number >= 1"),
    ],
)
def test_command_line_errors(tmp_path, fac, capsys, argv, expected):
    write_spec(tmp_path, f'[[job]]\nentry = "{fac}:make"\n')
    assert main(["launch", "spec.toml", "--dry-run", *argv]) == 2
    assert expected in capsys.readouterr().err


def test_target_must_be_a_spec_or_an_entry(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "sweep"]) == 2
    assert "'sweep' is neither a spec file (SPEC.toml) nor an entry point (module:function)" in capsys.readouterr().err
    assert main(["launch", "missing.toml"]) == 2
    assert "spec file 'missing.toml' does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------------------ dry run and entry points


def test_dry_run_prints_the_expanded_jobs_and_runs_nothing(tmp_path, fac, capsys):
    write_spec(tmp_path, f'''
        [runtime]
        policy = "srtf"
        [[job]]
        entry = "{fac}:make"
        steps = 9
        priority = 2
        params = {{ lr = [0.1, 0.2], width = 4 }}
    ''')
    assert main(["launch", "spec.toml", "--dry-run", "--memory", "512MiB"]) == 0
    out = capsys.readouterr().out
    assert "spec.toml: 2 job(s), policy srtf, memory 512MiB, quantum 1" in out
    for text in ("0_lr=0.1", "1_lr=0.2", f"{fac}:make", "lr=0.1, width=4", "lr=0.2, width=4"):
        assert text in out
    assert re.search(r"│\s+9 │\s+2 │", out)  # steps and priority columns
    assert not (tmp_path / "runs").exists()


def test_dry_run_of_the_example_sweep(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["launch", "examples/sweep.toml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "examples/sweep.toml: 4 job(s), policy pack, memory 2GiB, quantum 1" in out
    assert out.count("xshare.models.mlp:make_job") == 4


def test_dry_run_of_an_entry_point_with_sets(fac, capsys):
    assert main(["launch", f"{fac}:make", "--set", "lr=0.1,0.2", "--set", "width=8", "--replicas", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{fac}:make: 4 job(s)" in out
    assert "3_lr=0.2,seed=1" in out and "lr=0.2, seed=1, width=8" in out


def test_python_dash_m_xshare_help():
    proc = subprocess.run([sys.executable, "-m", "xshare", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: xshare" in proc.stdout
    for command in ("launch", "top", "bench"):
        assert command in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "xshare", "launch", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--dry-run" in proc.stdout
