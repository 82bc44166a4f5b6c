"""`dvc plots show` works offline and says what it plots: the page template (.dvc/config
plots.html_template, built by scripts/vendor_vega.py) inlines the vega libraries dvc-render would load
from a CDN; every plot of dvc.yaml has a title and axis labels, the same as the PNG the stage draws
(dare_core/training/plots.py); the RL validation curve is a plot. `dvc plots show` runs in a scratch
repository holding this one's dvc.yaml, params.yaml and .dvc/ plot settings, on CSVs written by the
stages' own writers; where node is installed, each plot is compiled and rendered with the vendored
vega, vega-lite and vega-embed, with no network."""
from __future__ import annotations

import configparser
import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dare_core.training.metrics import MetricsLogger
from dare_core.training.plots import STAGE_PLOTS, VALIDATION
from dare_core.training.rl.validation import validation_csv
from pipeline_helpers import copy_pipeline

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / ".dvc" / "plots" / "offline.html"
REMOTE_SCRIPT = re.compile(r"<script[^>]*\bsrc\s*=", re.IGNORECASE)


def _vendor():
    spec = importlib.util.spec_from_file_location("vendor_vega", REPO / "scripts" / "vendor_vega.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dvc_plots() -> dict[str, dict]:
    """dvc.yaml's stage plots: {"<stage>/<file>": props}, paths as written (${...} unresolved)."""
    plots = {}
    for stage, body in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].items():
        for entry in body.get("plots", []):
            (path, props), = entry.items()
            plots[f"{stage}/{path.rsplit('/', 1)[-1]}"] = props
    return plots


def test_template_is_offline_and_complete():
    page = TEMPLATE.read_text(encoding="utf-8")
    # dvc-render's placeholders: the plots and the refresh tag; not {scripts}, where its CDN tags go
    assert "{plot_divs}" in page and "{refresh_tag}" in page and "{scripts}" not in page
    assert not REMOTE_SCRIPT.search(page)
    vendor = _vendor()
    # the versions dvc-render's own page loads, each inlined with its licence
    versions = vendor.dvc_render_versions()
    assert versions == {name: version for name, version, _, _ in vendor.PACKAGES}
    inline = re.findall(r"<script>\n/\*! (\S+) (\S+) .*?\*/\n(.*?)\n    </script>", page, re.DOTALL)
    assert {name: version for name, version, _ in inline} == versions
    for name, _, code in inline:
        assert len(code) > 50_000 and "sourceMappingURL" not in code, name
    assert page.count("Redistribution and use in source and binary forms") == 3
    # dvc's config names it relative to .dvc/
    config = configparser.ConfigParser()
    config.read(REPO / ".dvc" / "config")
    assert (REPO / ".dvc" / config["plots"]["html_template"]).resolve() == TEMPLATE


def test_every_plot_is_titled_like_its_png():
    plots = _dvc_plots()
    expected = {f"{stage}/{key}.csv": spec for stage, specs in STAGE_PLOTS.items() for key, spec in specs.items()}
    expected["rl/validation.csv"] = VALIDATION
    assert set(plots) == set(expected)  # every CSV a loop writes is a plot, and nothing else
    for name, spec in expected.items():
        props = plots[name]
        assert (props["title"], props["x_label"], props["y_label"]) == (spec.title, spec.x_label, spec.y_label), name
        assert props["x"] == "step" and props["persist"] is True, name
        assert props.get("cache", True), name  # every plot CSV is cached (dvc push carries it)
        template = REPO / ".dvc" / "plots" / f"{props['template']}.json"
        assert template.is_file(), name
        if name != "rl/validation.csv":
            assert props["y"] == name.split("/")[1][:-len(".csv")] and props["template"] == "dare_line", name
    assert plots["rl/validation.csv"]["template"] == "dare_validation"


def _write_runs(repo: Path) -> dict[str, list]:
    """Each stage's plot files, written by its own writers (a single point where a run has logged
    once); returns {plot path: rows}."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    run = repo / params["run"]["runs_dir"] / params["run"]["name"]
    sft = MetricsLogger(run / "sft", plot_keys=("loss",))
    sft.log(10, {"loss": 2.5})
    sft.close()  # one logged step
    pref = MetricsLogger(run / "preference", plot_keys=tuple(STAGE_PLOTS["preference"]))
    for step in (5, 10):
        pref.log(step, {"loss": 0.69 / step, "reward_margin": 0.1 * step, "reward_accuracy": 0.5 + step / 40})
    pref.close()
    rl = MetricsLogger(run / "rl", plot_keys=("reward", "accuracy"))
    for step in (1, 2, 3):
        rl.log(step, {"reward": 0.2 * step, "accuracy": 0.25 * step})
    rl.close()
    rows = [{"step": s, "k": 4, "prompts": 64, "mean@4": 0.2 + s / 100, "best@4": 0.5 + s / 100, "maj@4": 0.3 + s / 100} for s in (0, 20)]
    (run / "rl" / "validation.csv").write_text(validation_csv(rows))
    return run


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A git + DVC repository with this one's pipeline and plot settings, and plot data."""
    repo = tmp_path_factory.mktemp("dvc_plots")
    copy_pipeline(repo)
    shutil.copy(REPO / "params.yaml", repo / "params.yaml")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, env=env)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True, env=env)
    shutil.copy(REPO / ".dvc" / "config", repo / ".dvc" / "config")
    shutil.copytree(REPO / ".dvc" / "plots", repo / ".dvc" / "plots")
    _write_runs(repo)
    show = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=repo, env=env,
                          capture_output=True, text=True)
    assert show.returncode == 0, show.stderr[-3000:]
    # from a subfolder: the page template and the plot templates are found from .dvc/, not the cwd
    sub = repo / "runs"
    page = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "-o", str(repo / "out")], cwd=sub, env=env,
                          capture_output=True, text=True)
    assert page.returncode == 0, page.stderr[-3000:]
    return repo, json.loads(show.stdout), (repo / "out" / "index.html").read_text(encoding="utf-8")


def test_dvc_plots_show_is_offline(scratch):
    _, _, page = scratch
    assert not REMOTE_SCRIPT.search(page) and "cdn.jsdelivr.net" not in page
    template = TEMPLATE.read_text(encoding="utf-8")
    for code in re.findall(r"<script>(.*?)</script>", template, re.DOTALL):
        assert code in page  # the vendored libraries, as they are in the template
    assert page.count("vegaEmbed(") == 7  # one plot per CSV


def test_dvc_plots_show_titles_axes_and_validation(scratch):
    _, shown, _ = scratch
    assert not shown.get("errors"), shown.get("errors")
    specs = {path.rsplit("/", 2)[-2] + "/" + path.rsplit("/", 1)[-1]: items[0]["content"] for path, items in shown["data"].items()}
    expected = {f"{stage}/{key}.csv": spec for stage, specs_ in STAGE_PLOTS.items() for key, spec in specs_.items()}
    expected["rl/validation.csv"] = VALIDATION
    assert set(specs) == set(expected)
    for name, spec in expected.items():
        content = specs[name]
        enc = content["encoding"]
        assert (content["title"]["text"], enc["x"]["title"], enc["y"]["title"]) == (spec.title, spec.x_label, spec.y_label)
        assert content["mark"]["point"] is True  # a one-point series shows
        assert enc["x"]["axis"]["format"] == "d"  # whole steps
    values = specs["sft/loss.csv"]["data"]["values"]
    assert [(v["step"], v["loss"]) for v in values] == [("10", "2.5")]
    val = specs["rl/validation.csv"]
    assert val["encoding"]["color"]["field"] == "metric" and val["encoding"]["y"]["scale"]["domain"] == [0, 1]
    assert sorted({v["metric"] for v in val["data"]["values"]}) == ["best@4", "maj@4", "mean@4"]
    assert len(val["data"]["values"]) == 6


RENDER_JS = r"""
const fs = require("fs"), vm = require("vm");
const html = fs.readFileSync(process.argv[2], "utf8");
const ctx = {console, setTimeout, clearTimeout, Promise, addEventListener() {}, removeEventListener() {}};
ctx.globalThis = ctx.self = ctx.window = ctx;
vm.createContext(ctx);
for (const m of html.matchAll(/<script>([\s\S]*?)<\/script>/g)) vm.runInContext(m[1], ctx);
const specs = JSON.parse(fs.readFileSync(process.argv[3], "utf8"));
(async () => {
  const out = {embed: typeof ctx.vegaEmbed, plots: []};
  for (const spec of specs) {
    try {
      const view = new ctx.vega.View(ctx.vega.parse(ctx.vegaLite.compile(spec).spec), {renderer: "none"});
      const svg = await view.toSVG();
      out.plots.push({texts: [...svg.matchAll(/<text[^>]*>([^<]*)<\/text>/g)].map(m => m[1]),
                      marks: (svg.match(/<path/g) || []).length});
    } catch (e) { out.plots.push({error: String(e)}); }
  }
  console.log(JSON.stringify(out));
})();
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_plots_render_with_the_vendored_libraries(scratch, tmp_path):
    """The page's own scripts, with no network: vega-lite compiles each plot, vega draws it (SVG) with
    its title and axis titles, and vega-embed loads."""
    repo, shown, _ = scratch
    contents = [items[0]["content"] for items in shown["data"].values()]
    (tmp_path / "specs.json").write_text(json.dumps(contents))
    (tmp_path / "render.js").write_text(RENDER_JS)
    r = subprocess.run(["node", str(tmp_path / "render.js"), str(repo / "out" / "index.html"), str(tmp_path / "specs.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["embed"] == "function"
    for content, plot in zip(contents, out["plots"]):
        assert "error" not in plot, (content["title"], plot)
        texts = {html.unescape(t) for t in plot["texts"]}
        assert {content["title"]["text"], content["encoding"]["x"]["title"], content["encoding"]["y"]["title"]} <= texts
        assert plot["marks"] > 0
