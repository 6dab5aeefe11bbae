from pathlib import Path

import pytest

from kvhandoff_lab.figures import save_figure


def test_save_figure_writes_png_closes_the_figure_and_keeps_the_old_file_on_error(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = tmp_path / "plot.png"
    fig, axis = plt.subplots()
    axis.plot([0, 1], [1, 0])
    assert save_figure(fig, path) == path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)  # closed
    before = path.read_bytes()
    broken, _ = plt.subplots()

    def half_written(target, **options):
        Path(target).write_bytes(b"\x89PN")
        raise OSError("disk full")

    broken.savefig = half_written
    with pytest.raises(OSError, match="disk full"):
        save_figure(broken, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]
