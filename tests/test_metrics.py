"""What TensorBoard and the console show of a run: the expert-load heatmaps
(components.train.metrics.heatmap_rgb and the logger that feeds it), the progress bar's final line
and the run summary's loss line."""

import io
import types

import numpy as np
import pytest
import torch

from components.train import metrics
from components.train.metrics import MetricsLogger, Progress, RunSummary, heatmap_rgb, heatmap_size
from components.train.step_log import StepLogger

RENDERERS = ["numpy", pytest.param("matplotlib", marks=pytest.mark.skipif(
    not metrics.have_matplotlib(), reason="matplotlib not installed (it is in .[dev])"))]
E, G, R = 8, 2, 6


def _ratio(rows=R, columns=E + G, seed=0):
    return np.random.default_rng(seed).uniform(0.2, 2.5, (rows, columns))


def _red(img):
    r, g, b = (img[..., i].astype(int) for i in range(3))
    return (r > 200) & (g < 80) & (b < 80)  # no viridis colour is red


@pytest.mark.parametrize("renderer", RENDERERS)
def test_cloned_experts_are_marked_in_their_row_and_column(renderer):
    """A clone draws a red mark on its home expert's cell at that step: the mark of (first step,
    expert 1) lies above and left of the mark of (last step, expert 6) - x is the expert index, y the
    step, newest at the bottom."""
    ratio = _ratio()
    none = np.full((R, G), -1)
    first, last = none.copy(), none.copy()
    first[0, 0] = 1
    last[R - 1, 1] = 6
    base, a, b = (heatmap_rgb(ratio, range(10, 10 + R), num_experts=E, slot_expert_RG=s, renderer=renderer)
                  for s in (none, first, last))
    assert not np.array_equal(base, a) and not np.array_equal(base, b)
    new_a, new_b = _red(a) & ~_red(base), _red(b) & ~_red(base)
    assert new_a.sum() >= 4 and new_b.sum() >= 4, (new_a.sum(), new_b.sum())
    (ya, xa), (yb, xb) = (np.argwhere(m).mean(0) for m in (new_a, new_b))
    assert ya < yb and xa < xb, ((ya, xa), (yb, xb))


@pytest.mark.parametrize("renderer", RENDERERS)
def test_size_is_fixed_and_readable_whatever_the_number_of_steps(renderer):
    few = heatmap_rgb(_ratio(3, E), range(3), renderer=renderer)
    many = heatmap_rgb(_ratio(64, E), range(64), renderer=renderer)
    assert few.shape == many.shape == (*heatmap_size(E), 3)
    assert few.dtype == np.uint8 and min(few.shape[:2]) >= 200
    wide = heatmap_rgb(_ratio(5, 256 + 32), range(5), num_experts=256, slot_expert_RG=np.zeros((5, 32), int),
                       renderer=renderer)
    assert wide.shape[:2] == heatmap_size(256 + 32) == (480, 1800)  # width grows with the experts, capped
    assert heatmap_size(E) == (480, 700)


@pytest.mark.parametrize("renderer", RENDERERS)
def test_scale_is_clipped_at_vmax(renderer):
    """load / mean above 3 is drawn in 3's colour; below it, colours differ."""
    ratio = _ratio(4, E)
    img = {v: heatmap_rgb(np.where(np.arange(E) == 2, v, ratio), renderer=renderer) for v in (2.0, 3.0, 10.0)}
    assert np.array_equal(img[3.0], img[10.0])
    assert not np.array_equal(img[2.0], img[3.0])


def test_logger_keeps_echo_slots_and_writes_readable_images(tmp_path, monkeypatch):
    """StepLogger hands each layer's (stats, load columns, slot experts) to the history; the images
    reach TensorBoard at a readable size; without matplotlib the run is told once."""
    monkeypatch.setattr(metrics, "have_matplotlib", lambda: False)
    told = []
    log = MetricsLogger(str(tmp_path), log=told.append)
    fake = types.SimpleNamespace(layers=[("1", None), ("2", None)], tb=log, summary=RunSummary())
    counts_LE = torch.tensor([[9.0, 1, 1, 1, 1, 1, 1, 1], [2.0] * 8])
    slots_G = torch.tensor([-1, -1, 0, -1])  # rank 1's first slot clones expert 0
    load = torch.tensor([4.0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 4, 0])
    for step in (5, 10):
        StepLogger._moe_values(fake, step, counts_LE, [(torch.tensor([1.5, 1.0, 1.0, 0.2]), load, slots_G), None])
        log.heatmaps(step)
    log.close()
    step, experts, row, slots = log.history["layer1"][-1]
    assert (step, experts) == (10, 8) and slots.tolist() == [-1, -1, 0, -1]
    assert row.tolist() == pytest.approx((load / 2).tolist())  # over the home experts' mean load (2)
    assert log.history["layer2"][-1][3] is None  # ECHO off for that layer
    assert len(told) == 1 and "matplotlib" in told[0]

    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    acc.Reload()
    for tag in ("moe/layer1/load_heatmap", "moe/layer2/load_heatmap"):
        imgs = acc.Images(tag)
        assert [i.step for i in imgs] == [5, 10]
        png = Image.open(io.BytesIO(imgs[-1].encoded_image_string))
        assert png.size == (imgs[-1].width, imgs[-1].height) and min(png.size) >= 200, png.size
    echo_img = np.asarray(Image.open(io.BytesIO(acc.Images("moe/layer1/load_heatmap")[-1].encoded_image_string)))
    assert _red(echo_img[..., :3]).any()  # expert 0's clone is marked


def test_progress_bar_draws_its_final_line_once(capsys):
    bar = Progress(total=3, initial=0, enabled=True)
    bar.bar.mininterval = 0  # draw on every update
    for step in (1, 2, 3):
        bar.update({"loss": f"{4 - step:.3f}"})
    bar.write("checkpoint: step-3")  # a message after the last step (the recipe's final checkpoint)
    bar.close()
    out = capsys.readouterr()
    assert out.err.count("3/3") == 1, out.err
    assert "checkpoint: step-3" in out.out


def test_a_failing_matplotlib_gives_the_plain_image_and_says_why_once(monkeypatch):
    def broken(*args):
        raise AttributeError("no such API in this matplotlib")

    monkeypatch.setattr(metrics, "_matplotlib_installed", lambda: True)
    monkeypatch.setattr(metrics, "_heatmap_matplotlib", broken)
    monkeypatch.setattr(metrics, "_MPL_FAILED", [])
    ratio = _ratio(4, E)
    with pytest.raises(AttributeError):
        heatmap_rgb(ratio, renderer="matplotlib")  # asked for by name: its error is raised
    assert np.array_equal(heatmap_rgb(ratio), heatmap_rgb(ratio, renderer="numpy"))
    assert not metrics.have_matplotlib()
    told = []
    log = MetricsLogger(None, log=told.append)
    log.writer = types.SimpleNamespace(add_image=lambda *a, **k: None, flush=lambda: None, close=lambda: None)
    log.record_load("layer1", 1, torch.ones(E))
    log.heatmaps(1)
    log.heatmaps(2)
    log.close()
    assert len(told) == 1 and "failed (AttributeError: no such API" in told[0], told


def test_summary_loss_line_says_what_it_averages():
    summary = RunSummary()
    summary.losses = [(step, 100.0 - step) for step in range(1, 21)]  # 20 logged steps: means of 2
    assert "loss           98.5000 -> 80.5000 (means of the first and last 2 logged steps)" in summary.text({})


def test_rank_load_is_the_busiest_ranks_share_of_its_experts():
    from components.train.metrics import rank_imbalance

    counts_E = torch.tensor([9.0, 1, 1, 1, 1, 1, 1, 1])  # experts 0-3 on rank 0, 4-7 on rank 1
    assert rank_imbalance(counts_E, 2) == pytest.approx(12 / 8)  # ranks 12 and 4 tokens, mean 8
    assert rank_imbalance(counts_E, 1) == pytest.approx(1.0)
    assert rank_imbalance(torch.tensor([0.0, 5, 5, 0]), 2) == pytest.approx(1.0)  # balanced ranks, idle experts
    summary = RunSummary()
    summary.rank_imbalance_plain += [1.5, 1.3]
    assert "rank load      max/mean 1.400" in summary.text({})
