"""The YAML config: defaults run locally, shipped examples validate, mistakes name the field."""

from __future__ import annotations

import pathlib

import pytest

from cluster.config import ConfigError, SplitspecConfig, load_config

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "cluster" / "configs"


def test_defaults_serve_the_bundled_model_with_ngram():
    c = load_config(None)
    assert c.model.path is None and c.model.dtype == "float32"
    assert [p.method for p in c.proposers] == ["ngram"]
    assert c.controller.policy == "goodput" and c.controller.max_k == 8 and c.controller.k == 4
    assert c.api.http_port != c.api.grpc_port


@pytest.mark.parametrize("name", ["local-cpu.yaml", "gpu-cluster.yaml", "bench-cpu.yaml", "bench-cpu-eagle.yaml",
                                  "bench-cpu-eagle-tree.yaml", "bench-cpu-eagle-dynamic-tree.yaml",
                                  "bench-cpu-all.yaml", "bench-cpu-qwen-coder.yaml", "bench-cpu-ngram-eagle.yaml"])
def test_shipped_examples_validate(name):
    c = load_config(CONFIG_DIR / name)
    assert isinstance(c, SplitspecConfig) and c.proposers


def test_a_leading_tilde_in_a_path_is_the_home_directory(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    c = SplitspecConfig.model_validate({
        "model": {"path": "~/models/t.gguf", "tokenizer": "tok/dir"},
        "proposers": [{"method": "draft", "options": {"path": "~/models/d.gguf", "base": "~/b.gguf", "max_k": 4}},
                      {"method": "ngram", "options": {"min_n": 2}}]})
    assert (c.model.path, c.model.tokenizer) == ("/home/someone/models/t.gguf", "tok/dir")
    assert c.proposers[0].options == {"path": "/home/someone/models/d.gguf", "base": "/home/someone/b.gguf", "max_k": 4}
    qwen = load_config(CONFIG_DIR / "bench-cpu-qwen-coder.yaml")
    assert qwen.model.path == "/home/someone/.cache/splitspec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert qwen.proposers[0].options["vocab_subset"] == 65536


def test_a_chat_template_file_is_read_into_the_config(tmp_path):
    """model.chat_template: a file's path becomes its text, so the replicas that validate
    the config again get the template itself; a template is kept as it is."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "chat.jinja").write_text(template)
    c = SplitspecConfig.model_validate({"model": {"chat_template": str(tmp_path / "chat.jinja")}})
    assert c.model.chat_template == template
    assert SplitspecConfig.model_validate(c.model_dump()).model.chat_template == template
    assert SplitspecConfig().model.chat_template is None


def test_controller_section_maps_onto_the_controller():
    from verifier.controller import ControllerSettings

    c = SplitspecConfig.model_validate({"controller": {"policy": "batch_table", "batch_table": {8: 1, 1: 3}}})
    assert c.controller.settings() == ControllerSettings(policy="batch_table", batch_table=((1, 3), (8, 1)))


def test_local_example_matches_what_it_says():
    c = load_config(CONFIG_DIR / "local-cpu.yaml")
    assert c.proposers[0].autoscaling.max_replicas == 2 and c.proposers[0].resources.num_cpus == 0.5
    g = load_config(CONFIG_DIR / "gpu-cluster.yaml")
    assert g.verifier.tensor_parallel_size == 2 and g.verifier.resources.num_gpus == 2


def test_a_bare_policy_off_is_the_off_policy(tmp_path):
    """YAML 1.1 reads an unquoted `off` as false: `policy: off` still means the off policy."""
    path = tmp_path / "off.yaml"
    path.write_text("controller: {policy: off}\n")
    assert load_config(path).controller.policy == "off"
    path.write_text("controller: {policy: true}\n")
    with pytest.raises(ConfigError, match="controller.policy: "):
        load_config(path)


@pytest.mark.parametrize(
    "yaml_text, field, fragment",
    [
        ("verifier: {max_num_seqs: 0}", "verifier.max_num_seqs", "greater than or equal to 1"),
        ("verifier: {max_num_seqs: eight}", "verifier.max_num_seqs", "'eight'"),
        ("verifier: {max_num_seqz: 8}", "verifier.max_num_seqz", "Extra inputs are not permitted"),
        ("proposers: [{method: magic}]", "proposers.0.method", "unknown method 'magic'"),
        ("proposers: [{method: ngram, autoscaling: {min_replicas: 3, max_replicas: 2}}]",
         "proposers.0.autoscaling", "min_replicas (3) must be <= max_replicas (2)"),
        ("proposers: [{method: ngram}, {method: ngram}]", "(top level)", "each method may appear once"),
        ("proposers: [{method: eagle, options: {tree: [3, 0]}}]", "proposers.0.options", "widths >= 1"),
        ("proposers: [{method: ngram, options: {tree: [2]}}]", "proposers.0", "model proposers, draft and eagle, only"),
        ("proposers: [{method: ngram, options: {dynamic_tree: 4}}]", "proposers.0", "options.dynamic_tree"),
        ("proposers: [{method: draft, options: {dynamic_tree: 0}}]", "proposers.0.options", "nodes a depth >= 1"),
        ("proposers: [{method: eagle, options: {tree: [2], dynamic_tree: 2}}]", "proposers.0.options",
         "exclude each other"),
        ("proposers: [{method: eagle, options: {tree_budget: 15}}]", "proposers.0.options", "set dynamic_tree too"),
        ("proposers: [{method: eagle, options: {vocab_subset: 1000}}]", "proposers.0", "method draft only"),
        ("proposers: [{method: draft, options: {vocab_subset: 0}}]", "proposers.0", "number of tokens >= 1"),
        ("proposers: [{method: draft, options: {dynamic_tree: 4, tree_budget: 0}}]", "proposers.0.options",
         "number of nodes >= 1"),
        ("proposers: [{method: ngram, fallback: eagle}]", "(top level)", "ngram's fallback must be another"),
        ("proposers: [{method: ngram, fallback: ngram}, {method: eagle}]", "(top level)", "got 'ngram'"),
        ("proposers: [{method: ngram, fallback: eagle}, {method: eagle, fallback: ngram}]", "(top level)",
         "has a fallback of its own"),
        ("proposers: [{method: ngram, placement: worker}]", "proposers.0.placement", "'deployment' or 'verifier'"),
        ("proposers: [{method: ngram, placement: verifier, replicas: 2}]", "proposers.0",
         "replicas: a proposer with placement 'verifier' runs inside each verifier replica"),
        ("proposers: [{method: ngram, placement: verifier, resources: {num_cpus: 1}}]", "proposers.0",
         "remove resources or use placement 'deployment'"),
        ("proposers: [{method: ngram, placement: verifier, autoscaling: {min_replicas: 1, max_replicas: 2}}]",
         "proposers.0", "remove autoscaling"),
        ("proposers: [{method: draft, placement: verifier, num_threads: 2}]", "proposers.0", "remove num_threads"),
        ("model: {dtype: float16}", "model.dtype", "'float16'"),
        ("model: {chat_template: no/such/chat.jinja}", "model.chat_template", "is neither a Jinja template"),
        ("model: {chat_template: '{% if %}'}", "model.chat_template", "does not compile"),
        ("model: {tool_call_parser: mistral}", "model.tool_call_parser", "'hermes'"),
        ("controller: {k: 40}", "controller.k", "less than or equal to 16"),
        ("controller: {policy: adaptive}", "controller.policy", "'adaptive'"),
        ("controller: {sequence_share: -0.1}", "controller.sequence_share", "greater than or equal to 0"),
        ("controller: {shadow_interval: 0}", "controller.shadow_interval", "greater than or equal to 1"),
        ("controller: {policy: batch_table, batch_table: {4: 2}}", "controller", "starting at 1"),
        ("api: {http_port: 8000, grpc_port: 8000}", "(top level)", "must differ"),
        ("verifier: {tensor_parallel_size: 2, resources: {num_gpus: 1}}", "verifier", "needs resources.num_gpus == 2"),
    ],
)
def test_mistakes_name_the_field(tmp_path, yaml_text, field, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"{field}: " in message and fragment in message, message


def test_unreadable_or_non_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("verifier: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_every_field_has_a_description():
    def walk(model_cls):
        for name, field in model_cls.model_fields.items():
            assert field.description, f"{model_cls.__name__}.{name} has no description"
            ann = field.annotation
            for sub in getattr(ann, "__args__", (ann,)):
                if isinstance(sub, type) and hasattr(sub, "model_fields"):
                    walk(sub)

    walk(SplitspecConfig)
