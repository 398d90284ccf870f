"""The Serve application graph built from a config (no cluster needed to build it)."""

from __future__ import annotations

import pytest
from ray.serve.deployment import Application

from cluster.config import LOCAL_CONFIG_PATH, SplitspecConfig, load_config
from cluster.deployments import app_builder, build_app, served_model_name


def test_model_names():
    assert served_model_name(SplitspecConfig()) == "SmolLM2-135M-Instruct"
    assert served_model_name(SplitspecConfig.model_validate({"model": {"path": "/m/qwen.Q4_K_M.gguf"}})) == "qwen.Q4_K_M"
    assert served_model_name(SplitspecConfig.model_validate({"model": {"path": "/m/Qwen2.5-1.5B/"}})) == "Qwen2.5-1.5B"
    assert served_model_name(SplitspecConfig.model_validate({"model": {"name": "mine"}})) == "mine"


def _deployments(app: Application) -> dict:
    """name -> deployment of every deployment reachable from the ingress."""
    found = {}

    def walk(node):
        d = node._bound_deployment
        found[d.name] = d
        for arg in list(d.init_args) + list(d.init_kwargs.values()):
            if isinstance(arg, Application):
                walk(arg)

    walk(app)
    return found


def test_graph_resources_and_autoscaling_follow_the_config():
    config = load_config(LOCAL_CONFIG_PATH)
    deps = _deployments(build_app(config))
    assert set(deps) == {"Ingress", "Verifier", "Proposer-ngram"}
    proposer = deps["Proposer-ngram"]
    assert proposer.ray_actor_options["num_cpus"] == 0.5
    auto = proposer._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 2, 4)
    assert auto.policy.policy_function == "cluster.autoscaling:proposer_load_policy"
    # Load is pushed twice per look-back window (10 s in this config).
    assert proposer.ray_actor_options["runtime_env"]["env_vars"] == {
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "5.0"}
    verifier = deps["Verifier"]
    assert verifier.ray_actor_options["num_cpus"] == 1
    assert verifier._deployment_config.autoscaling_config is None and verifier.num_replicas == 1
    # Serve admits more than the engine holds, so overload is the engine's own 429.
    v = config.verifier
    assert verifier.max_ongoing_requests > v.max_num_seqs + v.max_waiting
    assert deps["Ingress"].ray_actor_options["num_cpus"] == 0


def test_no_proposers_means_no_proposer_deployment():
    deps = _deployments(build_app(SplitspecConfig.model_validate({"proposers": []})))
    assert set(deps) == {"Ingress", "Verifier"}


def test_a_proposer_placed_in_the_verifier_has_no_deployment():
    config = SplitspecConfig.model_validate({"proposers": [
        {"method": "ngram", "placement": "verifier"}, {"method": "eagle", "resources": {"num_cpus": 0.25}}]})
    deps = _deployments(build_app(config))
    assert set(deps) == {"Ingress", "Verifier", "Proposer-eagle"}
    # The verifier gets the handle of the one deployed proposer, and every proposer's config.
    verifier_args = deps["Verifier"].init_args
    assert [a._bound_deployment.name for a in verifier_args if isinstance(a, Application)] == ["Proposer-eagle"]
    assert [p["placement"] for p in verifier_args[0]["proposers"]] == ["verifier", "deployment"]
    # The rendered config (every field, defaults included) validates back.
    assert SplitspecConfig.model_validate(config.model_dump(mode="json")) == config


def test_app_builder_takes_a_path_or_inline_sections(tmp_path):
    assert set(_deployments(app_builder({"config": str(LOCAL_CONFIG_PATH)}))) == {"Ingress", "Verifier", "Proposer-ngram"}
    inline = app_builder({"proposers": [], "verifier": {"max_num_seqs": 2}})
    assert set(_deployments(inline)) == {"Ingress", "Verifier"}
    with pytest.raises(Exception, match="max_num_seqs"):
        app_builder({"verifier": {"max_num_seqs": 0}})
