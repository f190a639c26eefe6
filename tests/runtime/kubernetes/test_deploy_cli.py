"""``gpufleet deploy k8s`` as a user runs it: one file per object, one-line errors."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.runtime.kubernetes import manifest_files, render

from .conftest import EXAMPLES, fleet_from

runner = CliRunner()


def test_writes_one_file_per_object_in_apply_order(tmp_path: Path) -> None:
    example = EXAMPLES[0]
    out = tmp_path / "k8s"
    args = ["deploy", "k8s", "--fleet", str(example), "--out", str(out), "--namespace", "ml"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    expected = manifest_files(render(fleet_from(example), "ml"))
    assert sorted(p.name for p in out.iterdir()) == [name for name, _ in expected]
    for name, text in expected:
        assert (out / name).read_text() == text
        assert yaml.safe_load(text)["metadata"].get("namespace", "ml") == "ml"
    assert f"wrote {len(expected)} manifest(s)" in result.stdout


def test_servicemonitor_flag_and_external_note(gpu_fleet_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "k8s"
    args = ["deploy", "k8s", "--fleet", str(gpu_fleet_file), "--out", str(out), "--servicemonitor"]
    result = runner.invoke(app, [*args, "--image-tag", "v0.19.0"])
    assert result.exit_code == 0, result.output
    kinds = [yaml.safe_load(p.read_text())["kind"] for p in sorted(out.iterdir())]
    assert kinds.count("ServiceMonitor") == 2
    assert "note: partner: external" in result.stdout
    assert "vllm/vllm-openai:v0.19.0" in (out / "09-deployment-llama-3-1-70b.yaml").read_text()


def test_default_fleet_when_no_file_is_given(tmp_path: Path) -> None:
    result = runner.invoke(app, ["deploy", "k8s", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "09-deployment-llama-3-1-8b.yaml").exists()


def test_warns_about_other_yaml_files_in_out(tmp_path: Path) -> None:
    (tmp_path / "old.yaml").write_text("kind: Secret\n")
    result = runner.invoke(app, ["deploy", "k8s", "--out", str(tmp_path)])
    assert result.exit_code == 0
    assert "warning:" in result.stdout
    assert "old.yaml" in result.stdout


def test_bad_fleet_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: x\n    gpu: no-such-gpu\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["deploy", "k8s", "--fleet", str(bad), "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ")
    assert "models[0]" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_unrenderable_fleet_and_bad_namespace_are_one_line_and_exit_2(tmp_path: Path) -> None:
    amd = tmp_path / "amd.yaml"
    amd.write_text("models:\n  - {name: big, model: x/y, engine: vllm, gpu: mi300x}\n")
    for args in (["--fleet", str(amd)], ["--namespace", "Bad_NS"]):
        result = runner.invoke(app, ["deploy", "k8s", "--out", str(tmp_path / "o"), *args])
        assert result.exit_code == 2
        assert len(result.stderr.strip().splitlines()) == 1
        assert result.stderr.startswith("error: ")


def test_tls_is_refused_and_the_auth_default_noted(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    for name in ("tls.pem", "tls.key"):
        (tmp_path / name).write_text("x")
    pem, key = tmp_path / "tls.pem", tmp_path / "tls.key"
    model = "models: [{name: llama-3.1-8b}]\n"
    fleet.write_text(f"gateway: {{tls: {{cert_file: {pem}, key_file: {key}}}}}\n{model}")
    result = runner.invoke(app, ["deploy", "k8s", "--fleet", str(fleet), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "gateway.tls: not rendered for Kubernetes" in result.output

    fleet.write_text("models: [{name: llama-3.1-8b}]\n")
    result = runner.invoke(app, ["deploy", "k8s", "--fleet", str(fleet), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "note: the gateway pod listens on 0.0.0.0, so it requires API keys" in result.stdout
    fleet.write_text("tenants: {auth: false}\nmodels: [{name: llama-3.1-8b}]\n")
    result = runner.invoke(app, ["deploy", "k8s", "--fleet", str(fleet), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "requires API keys" not in result.stdout
