"""The self-test HTML page, rendered in headless Chromium at 1400 px: no horizontal overflow, not
blank, pass colour shown; and its text: no Python reprs, version, command line, replay commands.

`.ci/run` installs Debian's `chromium` when it is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image

from kvcanary import __version__
from kvcanary.app.selftest.campaign import CampaignSpec, run_campaign
from kvcanary.app.selftest.report import html_report

COMMAND = "kvcanary selftest --modes late_write --plants retract_stale_row --seeds 1"


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = CampaignSpec(modes=("late_write",), plants=("retract_stale_row",), seeds=1)
    baseline, summaries = run_campaign(spec)
    path = tmp_path_factory.mktemp("html") / "selftest.html"
    path.write_text(html_report(baseline, summaries, command=COMMAND))
    return path


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "headless Chromium is needed: apt-get install -y chromium (.ci/run does it)"
    return found


def _headless(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--window-size=1400,1000", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.slow
def test_page_text_is_readable(page: Path) -> None:
    text = page.read_text()
    body = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", text)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", body)
    assert cells and not any(re.search(r"[\[\]{}]|'\w+'", c) for c in cells), cells
    assert "Clean baseline: 1 seeds, 0 violations" in body
    assert f"kvcanary {__version__}" in body and COMMAND in body
    assert body.count("kvcanary selftest --modes late_write --plants none --first-seed 0") == 1
    assert "--plants retract_stale_row --first-seed 0 --seeds 1" in body
    assert body.count("<tr class='pass'>") == 2


@pytest.mark.slow
def test_page_fits_1400_px_in_chromium(page: Path, tmp_path: Path) -> None:
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", "<script>document.body.setAttribute("
                     "'data-width', document.documentElement.scrollWidth)</script></body>"))  # fmt: skip
    dom = _headless("--dump-dom", probe.as_uri())
    width = re.search(r'data-width="(\d+)"', dom.stdout)
    assert width, dom.stderr[-2000:]
    assert int(width.group(1)) <= 1400


@pytest.mark.slow
def test_screenshot_is_not_blank_and_shows_the_pass_colour(page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "selftest.png"
    done = _headless(f"--screenshot={shot}", page.as_uri())
    assert shot.is_file(), done.stderr[-2000:]
    pixels = image.imread(str(shot))[..., :3]
    assert pixels.shape[1] == 1400
    assert pixels.std() > 0.05  # text, table lines and plots, not an empty page
    green = np.array([0xC8, 0xEF, 0xD4]) / 255  # tr.pass td.ok
    assert (np.abs(pixels - green).max(axis=-1) < 0.02).sum() > 200
    # nothing drawn in the right-hand margin: the page ends inside the window
    assert np.abs(pixels[:, -12:] - 1.0).max() < 0.02
