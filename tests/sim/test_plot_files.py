"""Plots appear whole or not at all: `save_figure` goes through `pagedkv.atomic_file`."""

from __future__ import annotations

import pytest


def test_a_plot_that_fails_half_way_leaves_the_old_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from pagedkv.sim.report.plot import _pyplot, save_figure

    plt = _pyplot()
    figure, _ = plt.subplots()
    path = tmp_path / "plot.svg"
    save_figure(figure, path)
    assert path.read_bytes().startswith(b"<?xml")  # the format its extension names
    before = path.read_bytes()

    def fail_half_way(file, **options):
        file.write(b"<?xml half a plot")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(figure, "savefig", fail_half_way)
    with pytest.raises(OSError, match="No space left"):
        save_figure(figure, path)
    plt.close(figure)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plot.svg"]


def save_titled(path: str, title: str, times: int, start_at: float) -> None:
    import time

    from pagedkv.sim.report.plot import _pyplot, save_figure

    plt = _pyplot()
    figure, axes = plt.subplots()
    axes.set_title(title)
    axes.plot(range(200), [i * len(title) for i in range(200)])
    time.sleep(max(0.0, start_at - time.monotonic()))  # everyone starts together
    for _ in range(times):
        save_figure(figure, path)


def test_concurrent_runs_plotting_one_path_leave_exactly_one_runs_plot(tmp_path):
    pytest.importorskip("matplotlib")
    import multiprocessing
    import time

    titles = [f"run {i}" + "!" * i for i in range(4)]
    expected = set()
    for title in titles:  # each run's own bytes, written alone
        save_titled(str(tmp_path / "alone.png"), title, 1, 0.0)
        expected.add((tmp_path / "alone.png").read_bytes())
    assert len(expected) == len(titles)
    context = multiprocessing.get_context("fork")
    start_at = time.monotonic() + 1.0
    shared = str(tmp_path / "shared.png")
    processes = [
        context.Process(target=save_titled, args=(shared, title, 5, start_at)) for title in titles
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0
    assert (tmp_path / "shared.png").read_bytes() in expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone.png", "shared.png"]
