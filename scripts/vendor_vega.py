"""(Re)build `.dvc/plots/offline.html`, the page template `dvc plots show` fills (`.dvc/config`:
`plots.html_template`), with vega, vega-lite and vega-embed inlined: the page works with no network.

DVC's own page (dvc-render's `VegaRenderer.SCRIPTS`) loads these three from cdn.jsdelivr.net, so it
is blank offline. This script takes the same versions, checks them against the installed dvc-render,
downloads each package's npm tarball (`npm pack`, the npm registry) unless `--tarballs DIR` already
holds them, checks each tarball against the sha512 integrity pinned below, and writes the template
with each package's `build/<name>.min.js` (the file cdn.jsdelivr.net serves for `npm/<name>@<version>`,
package.json's "jsdelivr" field) and its LICENSE text above it.

Vendored code and licences (all three: BSD-3-Clause, University of Washington Interactive Data Lab):
  vega 5.20.2        https://github.com/vega/vega         https://www.npmjs.com/package/vega/v/5.20.2
  vega-lite 5.2.0    https://github.com/vega/vega-lite    https://www.npmjs.com/package/vega-lite/v/5.2.0
  vega-embed 6.18.2  https://github.com/vega/vega-embed   https://www.npmjs.com/package/vega-embed/v/6.18.2
The minified bundles also contain their own small dependencies, under permissive licences: the d3-*
modules and topojson-client (ISC) in vega; clone, fast-deep-equal, fast-json-stable-stringify and
json-stringify-pretty-compact (MIT) and tslib (0BSD) in vega-lite; fast-json-patch (MIT), semver (ISC),
vega-themes, vega-tooltip and vega-schema-url-parser (BSD-3-Clause) in vega-embed.

The template keeps dvc-render's `{plot_divs}` and `{refresh_tag}` placeholders and drops `{scripts}`
(where dvc-render would put the CDN <script> tags). Run from the repository root:

    .venv/bin/python scripts/vendor_vega.py                 # downloads with npm
    .venv/bin/python scripts/vendor_vega.py --tarballs DIR  # vega-5.20.2.tgz, ... already in DIR

`tests/test_dvc_plots.py` checks the result: no remote script, the three libraries present, and
`dvc plots show` filling it.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".dvc" / "plots" / "offline.html"

# (package, version, global it defines, npm integrity of the tarball)
PACKAGES = [
    ("vega", "5.20.2", "vega",
     "sha512-qmH7aD9GGPpssVdxL1xgcdxTbQzyRUeRR16Os385ymvQhiwCYQNA6+eXUPAZDTVLfk0RXu6Jzj6kUE5jQ80EVw=="),
    ("vega-lite", "5.2.0", "vegaLite",
     "sha512-Yxcg8MvYfxHcG6BbkaKT0oVCIMIcE19UvqIsEwBmyd/7h2nzW7oRnID81T8UrY7hpDrIr6wa2JADOT2dhGNErw=="),
    ("vega-embed", "6.18.2", "vegaEmbed",
     "sha512-wcDyQPE4J5aiCDc3/suH5RQDvrKkjuLkhzUcbOLwEkNF8/+pp17tS0JghzEvAPNRg+5aG1/N2ydixq8Lk3dOlg=="),
]
# strings that must not occur in inlined code: dvc-render replaces its placeholders anywhere in the
# page, and a "</script" would end the inline script early
FORBIDDEN = ("{plot_divs}", "{scripts}", "{refresh_tag}", "</script")

PAGE = """<!DOCTYPE html>
<!-- DARE's page for `dvc plots show` (.dvc/config plots.html_template): vega, vega-lite and
     vega-embed are inlined below, so the plots draw with no network. Built by
     scripts/vendor_vega.py ({versions}); do not edit by hand. -->
<html>
<head>
    <meta charset="utf-8">
    {{refresh_tag}}
    <title>DARE plots</title>
{scripts}
    <style>
        body {{ font-family: sans-serif; display: flex; flex-wrap: wrap; gap: 24px; margin: 16px; }}
        body > div {{ flex: 0 0 auto; }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def dvc_render_versions() -> dict[str, str]:
    """The versions dvc-render's default page loads from the CDN: {package: version}."""
    from dvc_render.vega import VegaRenderer

    return dict(re.findall(r"cdn\.jsdelivr\.net/npm/([a-z-]+)@([0-9.]+)", VegaRenderer.SCRIPTS))


def integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def tarball(name: str, version: str, folder: Path | None) -> bytes:
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix="vendor-vega-"))
        subprocess.run(["npm", "pack", f"{name}@{version}"], cwd=folder, check=True, capture_output=True)
    return (folder / f"{name}-{version}.tgz").read_bytes()


def package_files(data: bytes, name: str) -> tuple[str, str]:
    """(build/<name>.min.js without its source-map comment, LICENSE) of an npm tarball."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        code = tar.extractfile(f"package/build/{name}.min.js").read().decode("utf-8")
        licence = tar.extractfile("package/LICENSE").read().decode("utf-8")
    code = re.sub(r"\n?//# sourceMappingURL=\S*\s*$", "", code)
    return code, licence


def build(folder: Path | None) -> str:
    pinned = {name: version for name, version, _, _ in PACKAGES}
    if dvc_render_versions() != pinned:
        raise SystemExit(f"dvc-render loads {dvc_render_versions()}, this script vendors {pinned}: update PACKAGES")
    scripts = []
    for name, version, _, expected in PACKAGES:
        data = tarball(name, version, folder)
        if integrity(data) != expected:
            raise SystemExit(f"{name}@{version}: the tarball's integrity is {integrity(data)}, expected {expected}")
        code, licence = package_files(data, name)
        for bad in FORBIDDEN:
            if bad in code or bad in licence:
                raise SystemExit(f"{name}@{version} contains {bad!r}: it cannot be inlined in the template")
        if "*/" in licence:
            raise SystemExit(f"{name}@{version}: its LICENSE would end the comment it is put in")
        scripts.append(f"    <script>\n/*! {name} {version} (npm, {expected})\n\n{licence.strip()}\n*/\n{code}\n    </script>")
    versions = ", ".join(f"{name} {version}" for name, version, _, _ in PACKAGES)
    return PAGE.format(versions=versions, scripts="\n".join(scripts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tarballs", type=Path, help="a folder holding the npm tarballs (no download)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    page = build(args.tarballs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page, encoding="utf-8")
    print(f"wrote {args.out} ({len(page.encode()) / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
