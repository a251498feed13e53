"""`dvc plots show` renders offline and `dvc exp show` has τ per suite, in a real DVC repo."""
import json
import re
import struct
import zlib

import numpy as np
import pytest

from deepspec.evaluate.run import compact_metrics, plot_rows
from deepspec.plots import render_png
from tests.conftest import run

pytestmark = pytest.mark.slow

BLUE, ORANGE = (0x4C, 0x78, 0xA8), (0xF5, 0x85, 0x18)  # Vega's first two category colours


def png_rgb(png: bytes) -> np.ndarray:
    """Decode an 8-bit, non-interlaced RGB/RGBA PNG (what vl-convert writes) into [H, W, 3]."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(png):
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        chunks.setdefault(kind, []).append(png[pos + 8:pos + 8 + n])
        pos += 12 + n
    w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"][0])
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(chunks[b"IDAT"])), np.uint8).reshape(h, w * bpp + 1)
    out = np.zeros((h, w * bpp), np.int32)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        up = out[y - 1] if y else np.zeros(w * bpp, np.int32)
        if f in (0, 2):
            out[y] = (line + (up if f == 2 else 0)) % 256
            continue
        row = np.zeros(w * bpp, np.int32)
        for x in range(w * bpp):  # Sub / Average / Paeth depend on the left neighbour
            a = row[x - bpp] if x >= bpp else 0
            b, c = up[x], (up[x - bpp] if x >= bpp else 0)
            if f == 1:
                pred = a
            elif f == 3:
                pred = (a + b) // 2
            else:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
            row[x] = (line[x] + pred) % 256
        out[y] = row
    img = out.reshape(h, w, bpp)
    if bpp == 4:  # composite on white, as a page would show it
        alpha = img[..., 3:] / 255
        img = (img[..., :3] * alpha + 255 * (1 - alpha)).astype(np.int32)
    return img


def pixels_near(img: np.ndarray, rgb, tol=12) -> int:
    return int((np.abs(img - np.array(rgb)).max(-1) <= tol).sum())


def test_png_decoder_reads_a_known_image():
    spec = {"data": {"values": [{"a": "x", "b": 1}]}, "mark": "bar", "width": 40, "height": 40,
            "encoding": {"x": {"field": "a", "type": "nominal"}, "y": {"field": "b", "type": "quantitative"}},
            "config": {"view": {"stroke": None}, "axis": {"disable": True}}}
    img = png_rgb(render_png(spec))
    assert pixels_near(img, BLUE) > 300 and pixels_near(img, (255, 255, 255), 0) > 300


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_plots_render_offline_and_exp_show_has_tau_per_suite(project):
    suite = {"tau": 3.6, "tau_sample": 2.9, "speedup": 2.1, "greedy_match": 1.0, "prompts": 40, "turns": 40}
    report = {"protocol": {"temperature": 0.7, "min_p": 0.0, "thinking": False},
              "suites": {"heldout": suite, "humaneval": suite | {"tau": 1.8, "tau_sample": 1.4, "prompts": 10,
                                                                 "turns": 10}}}
    # what a pipeline run leaves behind (written here: no pipeline run), outside DVC's tracking
    (project / "dvc.lock").unlink()
    write(project / "data/eval/metrics.json", json.dumps(compact_metrics(report)))
    write(project / "data/eval/plots/tau.json", json.dumps(plot_rows(report)))
    write(project / "data/cache/metrics.json", json.dumps({"bytes": 150_000_000}))
    write(project / "data/train/metrics.json", json.dumps({"final_loss": 0.52}))
    live = project / "data/train/live/plots/metrics/train"
    write(live / "loss.tsv", "step\tloss\n0\t5.0\n1\t3.0\n2\t2.0\n")
    write(live / "tau_greedy.tsv", "step\ttau_greedy\n0\t1.0\n1\t2.0\n2\t2.5\n")

    header = run(["dvc", "exp", "show", "--csv"], project).stdout.splitlines()[0].split(",")
    assert {"bytes", "final_loss", "heldout.tau", "heldout.tau_sample", "humaneval.tau",
            "humaneval.tau_sample", "protocol.temperature"} <= set(header)

    run(["python", "-m", "deepspec.plots", ".dvc/offline_plots.html"], project)  # what `make setup` runs
    run(["dvc", "plots", "show"], project)
    html = (project / "dvc_plots/index.html").read_text()
    assert not re.search(r"<script[^>]+src=", html) and "http://" not in html.replace(
        "http://www.w3.org", "") and "cdn.jsdelivr" not in html  # nothing to fetch
    assert "window.vegaEmbed=" in html
    specs = {m[0]: json.loads(m[1]) for m in
             re.findall(r'<div id = "([^"]+)">\s*<script type = "text/javascript">\s*var spec = (\{.*?\});\s*vegaEmbed',
                        html, re.S)}
    assert set(specs) == {"data_train_live_plots_metrics_train_loss_tsv",
                          "data_train_live_plots_metrics_train_tau_greedy_tsv", "data_eval_plots_tau_json"}
    for name, spec in specs.items():
        img = png_rgb(render_png(spec))
        assert (np.abs(img - 255).max(-1) > 30).mean() > 0.01, name  # not blank
    bars = png_rgb(render_png(specs["data_eval_plots_tau_json"]))
    assert pixels_near(bars, BLUE) > 2000 and pixels_near(bars, ORANGE) > 2000  # greedy and sampled bars
