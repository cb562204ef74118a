"""The end-to-end harness's parsing: the steady-state median and each run's peak memory, from a
torchtitan log line and from the recipe's metrics.jsonl."""

import json
import os
import sys

from conftest import ROOT

sys.path.insert(0, ROOT)
import pytest  # noqa: E402

from benchmarks.e2e import (combine_repeats, compare, disturbed_windows, failure_line, moe_setup,  # noqa: E402
                            no_steady_window, parse_variants, peak_gib, rank_load_in_steady, replays_in_steady, source_tree, steady,
                            with_overrides)


def test_steady_state_is_the_median_of_the_second_half():
    assert steady([(5, 1.0), (10, 9.0), (15, 3.0), (20, 5.0), (25, 4.0)], steps=20) == 4.0  # steps 15, 20, 25
    assert steady([(5, 1.0)], steps=20) is None


def test_windows_with_a_replay_or_its_recapture_are_left_out_of_the_steady_state():
    # cumulative replays as logged by a 60-step EP=2 run: replays in the windows ending at 25, 30 and 55; the
    # windows after (35, 60) hold the eager warm-up and the re-capture
    replayed = {5: 0, 10: 0, 15: 0, 20: 0, 25: 4, 30: 6, 35: 6, 40: 6, 45: 6, 50: 6, 55: 8, 60: 8}
    tps = {5: 150, 10: 209, 15: 199, 20: 206, 25: 76, 30: 102, 35: 143, 40: 205, 45: 192, 50: 204, 55: 105, 60: 209}
    rows = [{"step": s, "moe/replayed_steps": float(r), "tokens_per_s": tps[s]} for s, r in replayed.items()]
    skip = disturbed_windows(rows)
    assert skip == {25, 30, 35, 55, 60}
    assert steady(list(tps.items()), steps=60, skip=skip) == 204  # windows 40, 45, 50
    assert steady(list(tps.items()), steps=60) == (192 + 204) / 2  # every window from 35 on
    assert disturbed_windows([{"step": 5, "loss": 1.0}]) == set()  # EP=1: nothing to leave out
    assert steady([(35, 1.0)], steps=60, skip={35}) is None  # every window disturbed: no figure, an error
    msg = no_steady_window([(s, 1.0) for s in (30, 35, 40)], 40, {15, 30, 35, 40})
    assert "ending at steps 30, 35, 40)" in msg, msg  # the second half's only (step 15 is in the first)
    assert "--steps 90" in msg and "\n" not in msg, msg  # a second half that starts after step 45
    assert "log more often" in no_steady_window([(5, 1.0)], 40, set())


def test_repeats_give_the_median_and_the_spread_and_a_failed_repeat_is_the_error():
    rs = [{"run": "ours_graph", "tokens_per_s_per_gpu": v, "peak_gib": g, "replays": 2, "windows": 3, "folder": f}
          for v, g, f in ((100.0, 20.0, "a"), (120.0, 21.0, "b"), (90.0, 19.5, "c"))]
    row = combine_repeats(rs)
    assert row["tokens_per_s_per_gpu"] == 100.0 and row["repeats"] == 3
    assert abs(row["spread_pct"] - 30.0) < 1e-12  # (120 - 90) / 100
    assert row["peak_gib"] == 21.0 and row["replays"] == 6 and row["windows"] == 9
    assert row["repeat_tokens_per_s"] == [100.0, 120.0, 90.0] and row["folder"] == ["a", "b", "c"]
    even = combine_repeats(rs[:2])
    assert even["tokens_per_s_per_gpu"] == 110.0 and even["folder"] == ["a", "b"]
    assert combine_repeats(rs[:1]) is rs[0]  # one run: the row as measured, no spread column
    bad = combine_repeats([rs[0], {"run": "ours_graph", "error": "rc 1: boom", "folder": "d"}])
    assert bad["error"] == "repeat 2 of 2: rc 1: boom" and not bad.get("tokens_per_s_per_gpu")


def test_peak_memory_from_torchtitan_log_and_from_our_metrics(tmp_path):
    log = ("step:  5  loss:  7.1  grad_norm:  1.2  memory: 21.50GiB(15.4%)  tps: 9,000\n"
           "step: 10  loss:  6.0  grad_norm:  0.9  memory: 23.25GiB(16.6%)  tps: 9,500\n")
    assert peak_gib("torchtitan_compile", log, str(tmp_path)) == 23.25
    with open(os.path.join(tmp_path, "metrics.jsonl"), "w") as f:
        for step, peak in ((5, 18.0), (10, 18.5)):
            f.write(json.dumps({"step": step, "memory/peak_gib": peak, "memory/peer_gib": 8.75}) + "\n")
    assert peak_gib("ours_graph", "", str(tmp_path)) == 27.25  # torch's peak + the symmetric buffers


def test_replays_inside_the_steady_window_are_counted():
    # cumulative moe/replayed_steps as the recipe logs it: 4 replays before step 10, 2 more after
    rows = [{"step": s, "moe/replayed_steps": float(v)} for s, v in ((5, 1), (10, 4), (15, 4), (20, 6))]
    assert replays_in_steady(rows, steps=20) == 2  # only steps 11-20 count
    assert replays_in_steady(rows[:2], steps=20) == 0  # nothing logged after the first half
    assert replays_in_steady(rows, steps=8) == 6  # no row before the window: every replay counts
    assert replays_in_steady([{"step": 5, "loss": 1.0}], steps=20) == 0  # a run without the metric


def test_variants_parse_and_bad_specs_name_the_fix():
    assert parse_variants("") == [("", "")]
    assert parse_variants("torch=--moe_echo.experts_gemm torch; quack=--moe_echo.experts_gemm quack") == [
        ("torch", "--moe_echo.experts_gemm torch"), ("quack", "--moe_echo.experts_gemm quack")]
    with pytest.raises(ValueError, match="NAME=ARGS"):
        parse_variants("--moe_echo.experts_gemm quack")
    with pytest.raises(ValueError, match="repeats"):
        parse_variants("a=x;a=y")


def test_ratios_use_one_calls_best_torchtitan_and_pair_runs_within_a_variant():
    group = [{"run": "torchtitan", "tokens_per_s_per_gpu": 100.0},
             {"run": "torchtitan_compile", "tokens_per_s_per_gpu": 125.0},
             {"run": "ours_graph", "variant": "quack", "tokens_per_s_per_gpu": 150.0},
             {"run": "ours_compile_graph", "variant": "quack", "tokens_per_s_per_gpu": 200.0},
             {"run": "ours_graph", "variant": "torch", "tokens_per_s_per_gpu": 120.0},
             {"run": "ours_compile_graph", "variant": "torch", "tokens_per_s_per_gpu": 180.0},
             {"run": "ours_eager", "variant": "torch", "error": "rc 2: error: ..."}]
    compare(group)
    by = {(r["run"], r.get("variant")): r for r in group}
    assert by["ours_compile_graph", "quack"]["vs_torchtitan_best"] == 200 / 125
    assert by["ours_compile_graph", "quack"]["compile_vs_graph"] == 200 / 150  # not the torch variant's graph run
    assert by["ours_compile_graph", "torch"]["compile_vs_graph"] == 180 / 120
    assert "graph_vs_eager" not in by["ours_graph", "torch"]  # its eager run failed
    assert "vs_torchtitan_best" not in by["ours_eager", "torch"]


def test_a_failed_run_reports_the_recipes_one_line_error():
    log = ("W1126 launcher warning\n"
           "error: [moe_echo] experts_gemm = \"quack\" needs quack-kernels: pip install \"moe-echo[quack]\"\n"
           "Traceback (most recent call last):\n  raise ChildFailedError(\n"
           "============================================================\n")
    assert failure_line(log).startswith("error: [moe_echo] experts_gemm")
    assert failure_line("RuntimeError: CUDA out of memory\n=======\n") == "RuntimeError: CUDA out of memory"
    assert failure_line("") == ""


def test_the_moe_column_says_what_the_layers_ran_from_the_run_summary():
    """The run summary's dispatcher line, not the arguments: echo = "auto" decides inside the run."""
    log = ("step 60 loss 2.1\n"
           "dispatcher     NVLinkDispatcher, ECHO on (2 slots per rank), 2 token chunks per layer (overlap_chunks = auto)\n"
           "cuda graph     on (captured 1x)\n")
    assert moe_setup(log) == "nvlink+echo, 2 chunks"
    assert moe_setup("dispatcher     PaddedDispatcher\n") == "padded"
    assert moe_setup("dispatcher     HierarchicalDispatcher, 2 token chunks per layer (overlap_chunks = 2)\n") == \
        "hierarchical, 2 chunks"
    assert moe_setup("step: 25  loss: 3.2  tps: 12,345\n") == ""  # torchtitan's log has no such line


def test_the_table_has_a_moe_column_where_a_row_has_one(tmp_path):
    from benchmarks.e2e import render

    env = {"gpu": "NVIDIA H200", "torch": "t", "python": "p", "date": "d"}
    row = {"config": "c", "gpus": 4, "label": "b", "run": "ours", "variant": "auto", "tokens_per_s_per_gpu": 5.0}
    for rows, has in (([row], False), ([row, dict(row, variant="off", moe="nvlink+echo, 2 chunks")], True)):
        (tmp_path / "t.json").write_text(json.dumps({"env": env, "peak_tflops": 989.0, "rows": rows}))
        text = render(str(tmp_path / "t.json"))
        assert ("| variant | moe | tokens_per_s_per_gpu |" in text) == has, text
        assert ("| off | nvlink+echo, 2 chunks | 5 |" in text) == has, text


def test_step_time_uses_the_batch_shape_a_run_was_given():
    cfg = {"training": {"local_batch_size": 4, "seq_len": 4096}, "model": {"flavor": "a"}}
    ran = with_overrides(cfg, "--parallelism.expert_parallel_degree 2 --training.local_batch_size 2 "
                              "--training.seq_len=1024 --model.flavor b --training.steps 9")
    assert ran["training"] == {"local_batch_size": 2, "seq_len": 1024} and ran["model"]["flavor"] == "b"
    assert cfg["training"]["local_batch_size"] == 4  # the config itself is untouched
    assert with_overrides(cfg, "") == cfg


def test_flops_per_token_follow_the_model_size_keys():
    """[model] size keys (in the TOML or on the command line) change the FLOPs an e2e row's MFU uses."""
    from benchmarks.e2e import flops_per_token

    cfg = {"training": {"seq_len": 256}, "model": {"name": "deepseek_v3", "flavor": "tiny"}}
    base = flops_per_token(cfg)
    deeper = flops_per_token(with_overrides(cfg, "--model.n_layers 12"))
    assert flops_per_token({**cfg, "model": {**cfg["model"], "n_layers": 12}}) == deeper
    assert deeper > 1.5 * base


def test_merge_puts_another_calls_rows_into_the_results_file(tmp_path):
    """``--merge``: a GPU machine's e2e JSON joins the committed table of that GPU kind and GPU count
    (``e2e_<N>x<GPU>``); a row with the same key replaces the old one, the others stay, dates stay the measuring
    call's, the table is rewritten; rows of another GPU count go to their own file; ``--labels`` / ``--runs``
    pick rows (``-``: unlabelled), ``--table`` names a table of its own; a file that is not e2e output is one
    argparse line."""
    import subprocess

    def row(run, tps, label="a", date="d0", gpus=2):
        return {"config": "c", "gpus": gpus, "label": label, "run": run, "tokens_per_s_per_gpu": tps, "date": date,
                "torch": "t"}

    env = {"gpu": "NVIDIA H200", "torch": "t", "date": "d0"}
    out = tmp_path / "results"
    out.mkdir()
    (out / "e2e_2xH200.json").write_text(json.dumps(
        {"env": env, "peak_tflops": 989.0, "rows": [row("ours", 1.0), row("torchtitan", 2.0)]}))
    src = tmp_path / "fetched.json"
    src.write_text(json.dumps({"env": dict(env, date="d1"), "peak_tflops": 989.0,
                               "rows": [row("ours", 3.0, date="d1"), row("ours", 4.0, "b", "d1"),
                                        row("ours", 5.0, "", "d1", gpus=1)]}))
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "e2e.py"), "--out", str(out)]
    subprocess.run(cmd + ["--merge", str(src)], check=True, capture_output=True, text=True)
    data = json.loads((out / "e2e_2xH200.json").read_text())
    assert [(r["label"], r["run"], r["tokens_per_s_per_gpu"], r["date"]) for r in data["rows"]] == \
        [("a", "torchtitan", 2.0, "d0"), ("a", "ours", 3.0, "d1"), ("b", "ours", 4.0, "d1")]
    assert data["env"]["gpus"] == 2 and data["env"]["date"] == "d1"
    assert "| c | 2 | b | ours |  | 4 |" in (out / "e2e_2xH200.md").read_text()
    assert [r["tokens_per_s_per_gpu"] for r in json.loads((out / "e2e_1xH200.json").read_text())["rows"]] == [5.0]
    assert sorted(p.name for p in out.iterdir()) == ["e2e_1xH200.json", "e2e_1xH200.md", "e2e_2xH200.json",
                                                     "e2e_2xH200.md"]
    subprocess.run(cmd + ["--merge", str(src), "--labels=-,b", "--runs", "ours", "--table", "picked"], check=True,
                   capture_output=True, text=True)
    picked = {n: json.loads((out / f"e2e_picked_{n}xH200.json").read_text())["rows"] for n in (1, 2)}
    assert [r["label"] for r in picked[1]] == [""] and [r["label"] for r in picked[2]] == ["b"]
    bad = subprocess.run(cmd + ["--merge", str(tmp_path / "missing.json")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not an e2e results file" in bad.stderr and "Traceback" not in bad.stderr


def test_rank_load_is_averaged_over_the_steady_window_and_layers():
    rows = [{"step": 5, "moe/layer1/rank_load_max_over_mean": 9.0},
            {"step": 15, "moe/layer1/rank_load_max_over_mean": 1.5, "moe/layer2/rank_load_max_over_mean": 1.1},
            {"step": 20, "moe/layer1/rank_load_max_over_mean": 1.3, "moe/layer2/rank_load_max_over_mean": 1.1}]
    assert abs(rank_load_in_steady(rows, steps=20) - 1.25) < 1e-12  # step 5 is before the window
    assert rank_load_in_steady([{"step": 15, "loss": 1.0}], steps=20) is None  # EP=1: nothing logged


@pytest.mark.slow
def test_a_variant_runs_another_source_tree(tmp_path):
    """``@DIR`` variants time another revision's recipe in the same invocation: the run executes DIR's recipe and
    code (a marker patched into that tree's recipe shows in the run's log), with DIR's own config."""
    import argparse
    import shutil
    import tomllib

    from benchmarks.e2e import make_assets, measure

    tree = tmp_path / "base"
    for sub in ("recipes", "components", "kernels", "train_configs"):
        shutil.copytree(os.path.join(ROOT, sub), tree / sub, ignore=shutil.ignore_patterns("__pycache__"))
    recipe = tree / "recipes" / "pretrain.py"
    recipe.write_text(recipe.read_text().replace("def train(argv", "print('BASE-TREE-RECIPE')\n\n\ndef train(argv"))
    assert source_tree(f"@{tree} --training.steps 3") == (str(tree), "--training.steps 3")
    assert source_tree("--training.steps 3") == (ROOT, "--training.steps 3")
    with pytest.raises(ValueError, match="not a moe-echo source tree"):
        source_tree(f"@{tmp_path / 'missing'}")

    a = argparse.Namespace(nproc=1, steps=6, ours="", titan="", label="", timeout=300)
    cfg_path = os.path.join(ROOT, "train_configs", "debug_cpu.toml")
    with open(cfg_path, "rb") as f:
        cfg = tomllib.load(f)
    tok_dir, data = make_assets(str(tmp_path / "assets"))
    r = measure("ours_eager", a, cfg_path, cfg, tok_dir, data, str(tmp_path), "base", f"@{tree}")
    assert r.get("tokens_per_s_per_gpu", 0) > 0, r
    log = open(os.path.join(r["folder"], "run.log")).read()
    assert "BASE-TREE-RECIPE" in log and str(tree / "train_configs" / "debug_cpu.toml") in log.splitlines()[0]


def test_repeats_run_in_turn_and_land_as_one_row_each(tmp_path, monkeypatch):
    """``--repeats 2`` over two runs and two variants: A B C A B C order, one merged row per run and variant, ratios
    taken on the medians."""
    import benchmarks.e2e as e2e
    import torchtitan.tools.utils as tt_utils

    calls = []

    def fake_measure(run, a, cfg_path, cfg, tok_dir, data, work, variant="", extra=""):
        calls.append((run, variant))
        tps = {"torchtitan_compile": 100.0, "ours_graph": 150.0 + 10 * len(calls)}[run]
        return {"run": run, "tokens_per_s_per_gpu": tps, "peak_gib": 1.0, "folder": f"f{len(calls)}"}

    monkeypatch.setattr(e2e, "measure", fake_measure)
    monkeypatch.setattr(e2e, "make_assets", lambda folder: ("tok", "data.jsonl"))
    monkeypatch.setattr(e2e, "environment", lambda: {"gpu": "Test GPU", "torch": "t", "date": "d"})
    monkeypatch.setattr(tt_utils, "get_peak_flops", lambda name: 1e15)
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--configs", "debug_gpu", "--runs", "ours_graph,torchtitan_compile",
                                      "--variants", "x=;y=", "--repeats", "2", "--work", str(tmp_path / "w"),
                                      "--out", str(tmp_path)])
    e2e.main()
    assert calls == [("ours_graph", "x"), ("ours_graph", "y"), ("torchtitan_compile", "")] * 2
    rows = json.load(open(tmp_path / "e2e_1xTest.json"))["rows"]
    by = {(r["run"], r.get("variant", "")): r for r in rows}
    assert len(rows) == 3 and by[("ours_graph", "x")]["repeat_tokens_per_s"] == [160.0, 190.0]
    assert by[("ours_graph", "x")]["tokens_per_s_per_gpu"] == 175.0
    assert abs(by[("ours_graph", "y")]["vs_torchtitan_best"] - 1.85) < 1e-12  # median of 170 and 200 over 100
    assert "spread_pct" in open(tmp_path / "e2e_1xTest.md").read()


def test_gpu_counts_run_in_one_invocation_and_multi_gpu_rows_get_their_scaling(tmp_path):
    """--nproc 1,2,4: each count's arguments with {nproc} filled in; rows of 2+ GPUs get tokens/s per GPU over the
    1-GPU row of the same config, label, run and variant, shown as a percentage in the table."""
    import argparse

    from benchmarks.e2e import add_scaling, at_gpu_count, gpu_counts, render

    assert gpu_counts("2") == [2] and gpu_counts("1,2,4") == [1, 2, 4]
    for bad in ("0", "1,1", "two", ""):
        with pytest.raises(ValueError, match="--nproc"):
            gpu_counts(bad)
    a = argparse.Namespace(nproc="1,4", ours="--parallelism.expert_parallel_degree {nproc}", titan="")
    four = at_gpu_count(a, 4)
    assert (four.nproc, four.ours, a.ours) == (4, "--parallelism.expert_parallel_degree 4",
                                               "--parallelism.expert_parallel_degree {nproc}")
    row = dict(config="c", label="scale", run="ours_graph", variant="")
    rows = [dict(row, gpus=1, tokens_per_s_per_gpu=200.0), dict(row, gpus=2, tokens_per_s_per_gpu=194.0),
            dict(row, gpus=4, tokens_per_s_per_gpu=None, error="timeout"),
            dict(row, gpus=1, variant="echo", tokens_per_s_per_gpu=None, error="echo needs EP > 1"),
            dict(row, gpus=2, variant="echo", tokens_per_s_per_gpu=180.0),  # its 1-GPU row failed: the first's
            dict(row, gpus=2, run="titan", tokens_per_s_per_gpu=150.0)]  # no 1-GPU row of its run at all
    add_scaling(rows)
    assert rows[1]["scaling"] == pytest.approx(0.97) and "scaling_vs" not in rows[1]
    assert rows[4]["scaling"] == pytest.approx(0.90) and rows[4]["scaling_vs"] == ""
    assert all("scaling" not in r for r in (rows[0], rows[2], rows[3], rows[5]))
    path = tmp_path / "e2e_2xH100.json"
    path.write_text(json.dumps({"env": {"gpu": "H100", "torch": "2.11"}, "peak_tflops": 989.0,
                                "rows": [rows[1], rows[4]]}))
    table = render(str(path))
    header = next(l for l in table.splitlines() if l.startswith("| config"))
    assert "scaling" in [c.strip() for c in header.split("|")]
    assert "| 97.0% |" in table and "| 90.0% (vs no variant) |" in table


def test_gpu_run_script_refuses_options_given_as_arguments():
    """``run.sh scaling PART=b P=1,4`` would run part a (options are environment variables): one error line that
    shows the command to run, exit 2, nothing run."""
    import subprocess

    p = subprocess.run(["bash", "benchmarks/gpu/run.sh", "scaling", "PART=b", "P=1,4"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    assert p.stderr.strip().splitlines() == ["error: run.sh takes one suite name, got: scaling PART=b P=1,4; set the "
                                             "options before it: PART=b P=1,4 bash benchmarks/gpu/run.sh scaling"]
