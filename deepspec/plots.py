"""An offline page template for `dvc plots show`, and static PNG renders of the same charts.

DVC's default page loads Vega, Vega-Lite and Vega-Embed from a CDN, so it is blank without
network access. `write_template` writes a page template (`plots.html_template` in .dvc/config)
that carries those libraries inline, bundled by the `vl-convert-python` wheel from its pinned npm
releases; `make setup` writes it. `render_png` draws a Vega-Lite spec (e.g. one from
`dvc plots show --json`) with the same libraries, headless.

    python -m deepspec.plots .dvc/offline_plots.html     # the template (what `make setup` runs)
"""
from __future__ import annotations

import sys
from pathlib import Path

VEGA_LITE = "5.21"  # DVC's templates are Vega-Lite v5 specs

PAGE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {refresh_tag}
    <title>DVC Plot</title>
    <!-- vega {vega}, vega-lite {vega_lite}, vega-embed {vega_embed}, bundled by vl-convert-python {vlc}:
         no network needed (written by `python -m deepspec.plots`) -->
    <script type="text/javascript">
{bundle}
    </script>
    <style>
        table {{
            border-spacing: 15px;
        }}
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def page_template() -> str:
    import vl_convert as vlc
    from importlib.metadata import version

    bundle = vlc.javascript_bundle(vl_version=VEGA_LITE)  # assigns window.vegaEmbed / vega / vegaLite
    if "</script" in bundle.lower():
        raise RuntimeError("the Vega bundle contains '</script' and cannot be inlined")
    for placeholder in ("{plot_divs}", "{scripts}", "{refresh_tag}"):  # DVC fills these by str.replace
        if placeholder in bundle:
            raise RuntimeError(f"the Vega bundle contains DVC's placeholder {placeholder}")
    head, tail = PAGE.split("{bundle}")
    fmt = {"vega": vlc.get_vega_version(), "vega_lite": VEGA_LITE, "vega_embed": vlc.get_vega_embed_version(),
           "vlc": version("vl-convert-python"), "refresh_tag": "{refresh_tag}", "plot_divs": "{plot_divs}"}
    return head.format(**fmt) + bundle + tail.format(**fmt)


def write_template(path: str | Path) -> Path:
    from deepspec.io import atomic_open

    path = Path(path)
    with atomic_open(path) as f:
        f.write(page_template())
    return path


def render_png(spec: dict, scale: float = 1.0) -> bytes:
    import vl_convert as vlc

    return vlc.vegalite_to_png(spec, scale=scale, vl_version=VEGA_LITE)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m deepspec.plots OUTPUT.html")
    print(write_template(sys.argv[1]))
