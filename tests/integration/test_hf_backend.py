"""`--model-path` backend: checkpoint checks, LoRA target switches, batched sampling (Qwen3 and
Qwen3.5), Gumbel-max draws. Small random checkpoints on CPU; the full-vocabulary checkpoint runs
the SDK integration tests (tests/integration/test_local_server_sdk.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from dppo_harness.local_server.__main__ import parse_args
from dppo_harness.local_server.cli import check_model_path_flags
from dppo_harness.local_server.engine import attention, decode_cache, draws, hf_model, sampling
from dppo_harness.local_server.engine.engine import Engine
from dppo_harness.local_server.errors import UserError
from dppo_harness.local_server.serve import check_checkpoint

SMALL = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return hf_model.save_random_checkpoint(
        tmp_path_factory.mktemp("ck") / "small-qwen3", hf_model.qwen3_config(**SMALL), seed=1
    )


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory) -> Path:
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tie_word_embeddings=True,
    )
    return hf_model.save_random_checkpoint(tmp_path_factory.mktemp("ck35") / "small-qwen3_5", cfg, seed=2)


@pytest.fixture(scope="module")
def engine(qwen3_dir, tmp_path_factory):
    e = Engine(tmp_path_factory.mktemp("run"), model_path=qwen3_dir, device="cpu")
    yield e
    e.close()


# ---- checkpoint checks --------------------------------------------------------------------------


def _one_line_error(path, match: str) -> str:
    with pytest.raises(hf_model.CheckpointError, match=match) as ei:
        hf_model.check_checkpoint_dir(path)
    msg = str(ei.value)
    assert "\n" not in msg and str(Path(path).name) in msg
    return msg


def test_missing_or_incomplete_checkpoints_get_one_line_errors(tmp_path, qwen3_dir):
    _one_line_error(tmp_path / "nope", "no such directory")
    (tmp_path / "empty").mkdir()
    _one_line_error(tmp_path / "empty", "missing config.json")
    bad = tmp_path / "llama"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _one_line_error(bad, "not a Qwen3 / Qwen3.5 checkpoint")
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text((qwen3_dir / "config.json").read_text())
    _one_line_error(noweights, "no weights found")
    (noweights / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    _one_line_error(noweights, "missing shard")
    _path, cfg, files = hf_model.check_checkpoint_dir(qwen3_dir)  # the good one passes
    assert cfg["model_type"] == "qwen3" and [f.name for f in files] == ["model.safetensors"]


def test_cli_refuses_a_bad_model_path_with_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no such directory"):
        check_checkpoint(parse_args(["--model-path", str(tmp_path / "nope")]))
    with pytest.raises(SystemExit, match="exclusive"):
        check_model_path_flags(parse_args(["--model-path", str(tmp_path), "--model", "tiny-qwen3-random"]))
    src = str(Path(hf_model.__file__).resolve().parents[2])  # this checkout's src/, as LocalServerProcess does
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "dppo_harness.local_server", "--model-path", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"--model-path {tmp_path / 'nope'}: no such directory"]


def test_checkpoint_name_and_identity(tmp_path, engine, qwen3_dir):
    snap = tmp_path / "models--Qwen--Qwen3.5-2B" / "snapshots" / "abc123"
    assert hf_model.checkpoint_name(snap) == "Qwen/Qwen3.5-2B"
    assert hf_model.checkpoint_name(tmp_path / "my-ckpt") == "my-ckpt"
    assert engine.served_models == ["Qwen/Qwen3.5-2B", "small-qwen3", "local/small-qwen3"]
    assert engine.served_model_name == "local/small-qwen3" and engine.vocab.size == 1000
    assert engine.base_info["dtype"] == "float32" and engine.base_info["device"] == "cpu"


def test_served_name_overrides_the_checkpoint_name(qwen3_dir, tmp_path):
    e = Engine(tmp_path, model_path=qwen3_dir, device="cpu", served_name="my/served")
    try:
        assert e.served_models == ["Qwen/Qwen3.5-2B", "my/served", "local/small-qwen3"]
        with pytest.raises(UserError, match="not served"):
            e.create_model("small-qwen3", 4, 0)
    finally:
        e.close()


# ---- LoRA targets --------------------------------------------------------------------------------


def _targets(engine, mid: str) -> set[str]:
    return {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in engine._models[mid].params if "lora_A" in n}


def test_train_switches_select_lora_targets(engine):
    attn, mlp = {"q_proj", "k_proj", "v_proj", "o_proj"}, {"gate_proj", "up_proj", "down_proj"}
    assert _targets(engine, engine.create_model("Qwen/Qwen3.5-2B", 4, 0)) == attn | mlp | {"lm_head"}
    assert _targets(engine, engine.create_model("Qwen/Qwen3.5-2B", 4, 0, train_mlp=False, train_unembed=False)) == attn
    assert _targets(engine, engine.create_model("Qwen/Qwen3.5-2B", 4, 0, train_attn=False, train_unembed=False)) == mlp
    assert _targets(engine, engine.create_model("Qwen/Qwen3.5-2B", 4, 0, train_attn=False, train_mlp=False)) == {
        "lm_head"
    }
    with pytest.raises(UserError, match="nothing to train"):
        engine.create_model("Qwen/Qwen3.5-2B", 4, 0, train_attn=False, train_mlp=False, train_unembed=False)


def test_only_lora_parameters_train_and_targets_survive_restore(engine):
    mid = engine.create_model("Qwen/Qwen3.5-2B", 8, 3, train_unembed=False)
    tm = engine._models[mid]
    assert all("lora_" in n for n, _ in tm.params) and tm.params
    frozen = [n for n, q in tm.net.named_parameters() if q.requires_grad and "lora_" not in n]
    assert frozen == []
    toks = list(range(10, 40))
    data = [(toks[:-1], {"target_tokens": np.array(toks[1:]), "weights": np.ones(29, np.float32)})]
    engine.forward_backward(mid, data, "cross_entropy")
    engine.optim_step(mid, {"learning_rate": 1e-2})
    path = engine.save_state(mid, "targets")
    mid2 = engine.create_model_from_state(path, with_optimizer=True)
    assert _targets(engine, mid2) == _targets(engine, mid) and "lm_head" not in _targets(engine, mid2)
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        engine.forward(
            mid,
            [([1, 2, 1000], {"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, np.float32)})],
            "cross_entropy",
        )


# ---- sampling ------------------------------------------------------------------------------------


def test_gumbel_max_draws_follow_softmax_and_are_seeded():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(40_000, 1)
    drawn = draws.gumbel_max(logits, torch.Generator().manual_seed(0))
    freq = torch.bincount(drawn, minlength=5).float() / drawn.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), rtol=0, atol=0.01)
    again = draws.gumbel_max(logits[:100], torch.Generator().manual_seed(0))
    other = draws.gumbel_max(logits[:100], torch.Generator().manual_seed(1))
    assert torch.equal(again, drawn[:100]) and not torch.equal(other, again)
    # -inf (filtered) entries are never drawn
    masked = draws.filter_logits(logits[:2000], 1.0, 2, 1.0)
    assert set(draws.gumbel_max(masked, torch.Generator().manual_seed(2)).tolist()) <= {0, 1}


def _req(prompt, n, seed, stop=()):
    return sampling.DecodeRequest(
        prompt=list(prompt),
        n=n,
        max_tokens=10,
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        stop_ids=list(stop),
        stop_strings=[],
        seed=seed,
        want_prompt_lp=True,
    )


def _trainer_logprobs(engine, mid, prompt, seq):
    full = list(prompt) + list(seq.tokens)
    return engine.compute_logprobs(mid, [(full[:-1], {"target_tokens": np.array(full[1:])})])[0].numpy()


@pytest.mark.parametrize(
    ("arch", "mode"), [("qwen3", "dynamic"), ("qwen3", "static"), ("qwen3_5", "dynamic"), ("qwen3_5", "static")]
)
def test_batched_requests_match_alone_and_the_trainer(arch, mode, qwen3_dir, qwen35_dir, tmp_path):
    """Two prompts of different lengths in one decode loop (left-padded prefill, rows finishing
    early on a stop token; batch compaction in "dynamic", fixed shapes in "static", the eager form
    of the CUDA-graph step) give each request's own tokens, and every logprob equals the trainer's
    forward."""
    e = Engine(tmp_path, model_path=qwen3_dir if arch == "qwen3" else qwen35_dir, device="cpu")
    try:
        mid = e.create_model("Qwen/Qwen3.5-2B", 4, 0)
        net = e._sampler_net(e.save_for_sampler(mid, "s"))
        p1, p2 = list(range(100, 109)), list(range(300, 317))
        stats: dict = {}
        with torch.no_grad():
            alone1 = sampling.generate(net, [_req(p1, 3, 5)], e._decode_text, e.decode_spec, mode)[0]
            stop = [alone1[0].tokens[2], alone1[1].tokens[4]]  # make rows finish at different steps
            alone1 = sampling.generate(net, [_req(p1, 3, 5, stop)], e._decode_text, e.decode_spec, mode)[0]
            alone2 = sampling.generate(net, [_req(p2, 4, 6)], e._decode_text, e.decode_spec, mode)[0]
            both = sampling.generate(
                net, [_req(p1, 3, 5, stop), _req(p2, 4, 6)], e._decode_text, e.decode_spec, mode, stats
            )
        assert stats["decode_mode"] == mode and stats["rows"] == 7
        assert any(s.stop_reason == "stop" for s in alone1) and any(s.stop_reason == "length" for s in alone1)
        for got, want in ((both[0], alone1), (both[1], alone2)):
            assert [s.tokens for s in got] == [s.tokens for s in want]
            for a, b in zip(got, want):
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        for prompt, seqs in ((p1, both[0]), (p2, both[1])):
            for s in seqs:
                lp = _trainer_logprobs(e, mid, prompt, s)
                np.testing.assert_allclose(lp[len(prompt) - 1 :], s.logprobs, atol=1e-5)
                np.testing.assert_allclose(lp[: len(prompt) - 1], s.prompt_logprobs[1:], atol=1e-5)
    finally:
        e.close()


def test_decode_mode_resolution(engine, qwen35_dir, tmp_path):
    """CPU: auto -> dynamic, graph -> its eager form; Qwen3.5's hybrid cache has a static step,
    a sliding-window cache has none."""
    net = engine.base_model
    buffered = decode_cache.buffered_cache(transformers.DynamicCache(), 4)  # no layers yet: trivially "pure attention"
    assert sampling.resolve_mode("auto", net, buffered) == "dynamic"
    assert sampling.resolve_mode("graph", net, buffered) == "static"
    assert sampling.resolve_mode("static", net, buffered) == "static"
    with pytest.raises(ValueError, match="decode mode"):
        sampling.resolve_mode("fast", net, buffered)
    cfg = hf_model.qwen3_config(**SMALL)
    cfg.use_sliding_window, cfg.sliding_window, cfg.max_window_layers = True, 4, 0
    cfg.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
    sliding = transformers.Qwen3ForCausalLM(cfg)
    assert sliding.get_decoder().has_sliding_layers
    assert sampling.resolve_mode("static", sliding, buffered) == "dynamic"
    e = Engine(tmp_path, model_path=qwen35_dir, device="cpu", decode_mode="static")
    try:
        e.sample("Qwen/Qwen3.5-2B", [1, 2, 3], 2, 3, 1.0, -1, 1.0, [], [], 0, False)
        assert e.last_sample_stats["decode_mode"] == "static"
    finally:
        e.close()
    with pytest.raises(UserError, match="decode_mode"):
        Engine(tmp_path, model_path=qwen35_dir, device="cpu", decode_mode="fast")


def _hybrid_prefill(net, prompts: list[list[int]], n: int, cap: int):
    reqs = [
        sampling.DecodeRequest(
            prompt=p,
            n=n,
            max_tokens=cap,
            temperature=1.0,
            top_k=-1,
            top_p=1.0,
            stop_ids=[],
            stop_strings=[],
            seed=0,
            want_prompt_lp=False,
        )
        for p in prompts
    ]
    rows = torch.tensor([j for j in range(len(prompts)) for _ in range(n)])
    Lp = max(len(p) for p in prompts)
    pre = sampling._prefill_batched(
        net, reqs, sampling.DecodeSpec(vocab_size=net.get_output_embeddings().weight.shape[0]), rows, Lp + cap
    )
    attn_RC = torch.zeros((len(rows), Lp + cap), dtype=torch.int64)
    attn_RC[:, :Lp] = pre.mask_JL[rows]
    return pre, attn_RC, torch.tensor([len(prompts[j]) for j in rows.tolist()]), Lp


def test_hybrid_static_step_equals_the_dynamic_cache(qwen35_dir):
    """Qwen3.5 (linear + full attention): the fixed-shape step (KV written at a device-held
    column, transformers' linear-attention states advanced in place at fixed addresses), run
    eagerly as the CUDA graph would replay it, gives the dynamic cache's logits step by step; a
    step whose recurrent state was not carried forward is caught."""
    net = transformers.AutoModelForCausalLM.from_pretrained(qwen35_dir, local_files_only=True).eval()
    kinds = {type(lay).__name__ for lay in transformers.DynamicCache(config=net.config).layers}
    assert kinds == {"LinearAttentionLayer", "DynamicLayer"}  # both layer types
    prompts, steps = [list(range(100, 109)), list(range(300, 313))], 5
    feed = torch.randint(0, 1000, (steps, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pre_d, attn_d, pos_d, Lp = _hybrid_prefill(net, prompts, 2, steps + 1)
        pre_s, attn_s, pos_s, _ = _hybrid_prefill(net, prompts, 2, steps + 1)
        step = decode_cache.StaticDecodeStep(net, pre_s.cache_R, attn_s, use_graph=False)
        linear = [lay for lay in step.cache.layers if type(lay).__name__ == "LinearAttentionLayer"]
        assert linear and any(type(lay).__name__ == "StaticKVLayer" for lay in step.cache.layers)
        ptrs = [(lay.conv_states.data_ptr(), lay.recurrent_states.data_ptr()) for lay in linear]
        cache = pre_d.cache_R

        def dynamic_step(ids, t):
            attn_d[:, Lp + t] = 1
            out = net.get_decoder()(
                input_ids=ids.unsqueeze(-1),
                attention_mask=attn_d[:, : Lp + t + 1],
                position_ids=(pos_d + t).unsqueeze(-1),
                past_key_values=cache,
                use_cache=True,
            )
            return net.get_output_embeddings()(out.last_hidden_state[:, -1]).float()

        for t in range(steps):
            before = [lay.recurrent_states.clone() for lay in linear]
            torch.testing.assert_close(step(feed[t], pos_s + t, Lp + t), dynamic_step(feed[t], t), rtol=1e-4, atol=1e-5)
        assert [(lay.conv_states.data_ptr(), lay.recurrent_states.data_ptr()) for lay in linear] == ptrs
        assert all(not torch.equal(b, lay.recurrent_states) for b, lay in zip(before, linear))
        # negative control: roll the recurrent state back one step, the next step differs
        for b, lay in zip(before, linear):
            lay.recurrent_states.copy_(b)
        got = step(feed[0], pos_s + steps, Lp + steps)
        assert not torch.allclose(got, dynamic_step(feed[0], steps), rtol=1e-4, atol=1e-5)


def test_hybrid_static_decode_gives_the_dynamic_tokens(qwen35_dir, tmp_path):
    """The whole sampler on Qwen3.5: "static" (the eager form of the captured graph) and
    "dynamic" give the same tokens under the same seeds, rows stopping at different steps."""
    e = Engine(tmp_path, model_path=qwen35_dir, device="cpu")
    try:
        net = e._sampler_net("base")
        p1, p2 = list(range(100, 109)), list(range(300, 317))
        with torch.no_grad():
            probe = sampling.generate(net, [_req(p1, 3, 5)], e._decode_text, e.decode_spec, "dynamic")[0]
            reqs = [_req(p1, 3, 5, [probe[0].tokens[2], probe[1].tokens[5]]), _req(p2, 4, 6)]
            runs = {}
            for mode in ("dynamic", "static"):
                stats: dict = {}
                runs[mode] = sampling.generate(net, reqs, e._decode_text, e.decode_spec, mode, stats)
                assert stats["decode_mode"] == mode
        assert any(s.stop_reason == "stop" for s in runs["static"][0])
        assert any(s.stop_reason == "length" for seqs in runs["static"] for s in seqs)
        for a, b in zip(runs["dynamic"], runs["static"]):
            assert [s.tokens for s in a] == [s.tokens for s in b]
            assert [s.stop_reason for s in a] == [s.stop_reason for s in b]
            for x, y in zip(a, b):
                np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    finally:
        e.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_graph_decode_gives_the_eager_tokens_on_cuda(qwen35_dir, qwen3_dir, tmp_path):
    """On CUDA the captured step (Qwen3 and the Qwen3.5 hybrid) gives the eager step's tokens."""
    for d in (qwen3_dir, qwen35_dir):
        e = Engine(tmp_path / d.name, model_path=d, device="cuda", dtype="float32")
        try:
            net = e._sampler_net("base")
            reqs = [_req(list(range(100, 109)), 3, 5), _req(list(range(300, 317)), 4, 6)]
            runs, modes = {}, {}
            with torch.no_grad():
                for mode in ("static", "graph"):
                    stats: dict = {}
                    runs[mode] = sampling.generate(net, reqs, e._decode_text, e.decode_spec, mode, stats)
                    modes[mode] = stats["decode_mode"]
            assert modes == {"static": "static", "graph": "graph"}, modes
            assert [[s.tokens for s in r] for r in runs["graph"]] == [[s.tokens for s in r] for r in runs["static"]]
        finally:
            e.close()


def _lora_modules(engine, mid: str) -> dict[str, set[str]]:
    """Adapted module names by where they sit: linear_attention, full_attention, mlp, unembed."""
    out: dict[str, set[str]] = {}
    for name, _ in engine._models[mid].params:
        if "lora_A" not in name:
            continue
        path = name.split(".lora_A")[0]
        where = (
            "linear_attention"
            if ".linear_attn." in path
            else "full_attention"
            if ".self_attn." in path
            else "mlp"
            if ".mlp." in path
            else "unembed"
            if path.endswith("lm_head")
            else path
        )
        out.setdefault(where, set()).add(path.rsplit(".", 1)[-1])
    return out


def test_qwen35_lora_targets_per_switch_and_layer_type(qwen35_dir, tmp_path):
    """Tinker's switches on Qwen3.5: train_attn adapts the Gated DeltaNet's five projections and
    the full-attention q/k/v/o; the DeltaNet's conv1d, A_log, dt_bias and gated norm never train;
    train_mlp the MLPs of both layer kinds; train_unembed lm_head. LoRA on the DeltaNet trains."""
    e = Engine(tmp_path, model_path=qwen35_dir, device="cpu")
    try:
        assert type(e.base_model).__name__ == "Qwen3_5ForCausalLM"
        linear = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
        full, mlp = {"q_proj", "k_proj", "v_proj", "o_proj"}, {"gate_proj", "up_proj", "down_proj"}
        attn_only = e.create_model("Qwen/Qwen3.5-2B", 4, 0, train_mlp=False, train_unembed=False)
        assert _lora_modules(e, attn_only) == {"linear_attention": linear, "full_attention": full}
        mlp_only = e.create_model("Qwen/Qwen3.5-2B", 4, 0, train_attn=False, train_unembed=False)
        assert _lora_modules(e, mlp_only) == {"mlp": mlp}
        head_only = e.create_model("Qwen/Qwen3.5-2B", 4, 0, train_attn=False, train_mlp=False)
        assert _lora_modules(e, head_only) == {"unembed": {"lm_head"}}
        every = e.create_model("Qwen/Qwen3.5-2B", 4, 0)
        assert _lora_modules(e, every) == {
            "linear_attention": linear,
            "full_attention": full,
            "mlp": mlp,
            "unembed": {"lm_head"},
        }
        # each linear-attention layer gets all five, each full-attention layer all four
        types = e.base_model.config.layer_types
        names = [n for n, _ in e._models[attn_only].params if "lora_A" in n]
        assert sum(".linear_attn." in n for n in names) == 5 * types.count("linear_attention")
        assert sum(".self_attn." in n for n in names) == 4 * types.count("full_attention")
        trainable = {n for n, q in e._models[every].net.named_parameters() if q.requires_grad}
        assert all("lora_" in n for n in trainable)
        assert not any(k in n for n in trainable for k in ("conv1d", "A_log", "dt_bias", "linear_attn.norm"))
        toks = list(range(10, 40))
        e.forward_backward(
            attn_only,
            [(toks[:-1], {"target_tokens": np.array(toks[1:]), "weights": np.ones(29, np.float32)})],
            "cross_entropy",
        )
        grads = e.get_parameter_grads(attn_only)
        for proj in linear:
            g = [v for n, v in grads.items() if f".linear_attn.{proj}.lora_B" in n]
            assert g and all(float(v.abs().sum()) > 0 for v in g), proj
    finally:
        e.close()


def _fake_fast(fn):
    def wrapped(*a, **k):
        return fn(*a, **k)

    wrapped.__module__ = "fla.ops.fake"
    return wrapped


def test_kernel_report_names_the_torch_fallback_and_why(qwen35_dir, engine, tmp_path):
    report = hf_model.kernel_report(engine.base_model)  # Qwen3: attention only
    assert report["linear_attention"] is None and report["full_attention"]["layers"] == 2
    e = Engine(tmp_path, model_path=qwen35_dir, device="cpu")
    try:
        la = e.kernels["linear_attention"]
        assert la["layers"] == 3 and e.kernels["full_attention"] == {"layers": 1, "implementation": attention.SDPA_GQA}
        assert la["path"] == "torch fallback" and not any(la["fast"].values())
        assert la["implementations"]["delta_rule_recurrent"].endswith("torch_recurrent_gated_delta_rule")
        assert la["transformers"]["is_fast_path_available"] is False
        if not torch.cuda.is_available():
            assert any("no CUDA device" in r for r in la["reasons"])
        assert "torch fallback" in hf_model.kernel_summary(e.kernels)
        # the report reads what the layers will call: a (fake) fla function shows as fast, and
        # use_torch_linear_attention puts the torch implementations back
        for m in e.base_model.modules():
            if type(m).__name__.endswith("GatedDeltaNet"):
                m.recurrent_gated_delta_rule = _fake_fast(m.recurrent_gated_delta_rule)
        mixed = hf_model.kernel_report(e.base_model)["linear_attention"]
        assert mixed["path"] == "mixed" and mixed["fast"]["delta_rule_recurrent"]
        assert hf_model.use_torch_linear_attention(e.base_model) == 3
        assert hf_model.kernel_report(e.base_model)["linear_attention"]["path"] == "torch fallback"
    finally:
        e.close()


def test_linear_attention_option_forces_the_torch_fallback(qwen35_dir, tmp_path, monkeypatch):
    """`Engine(linear_attention=...)` / `--linear-attention`: with a (fake) fla recurrent kernel
    found at load, "auto" keeps it and "torch" replaces it; bad values are one-line errors."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    monkeypatch.setattr(
        modeling_qwen3_5,
        "fused_recurrent_gated_delta_rule",
        _fake_fast(modeling_qwen3_5.torch_recurrent_gated_delta_rule),
    )
    for option, path in (("auto", "mixed"), ("torch", "torch fallback")):
        e = Engine(tmp_path / option, model_path=qwen35_dir, device="cpu", linear_attention=option)
        try:
            assert e.kernels["linear_attention"]["path"] == path
            assert len(e.sample("Qwen/Qwen3.5-2B", [1, 2, 3], 2, 3, 1.0, -1, 1.0, [], [], 0, False)) == 2
        finally:
            e.close()
    with pytest.raises(UserError, match="linear_attention"):
        Engine(tmp_path / "bad", model_path=qwen35_dir, device="cpu", linear_attention="fla")
    with pytest.raises(SystemExit, match="need --model-path"):
        check_model_path_flags(parse_args(["--linear-attention", "torch"]))
    assert parse_args(["--model-path", "x", "--decode-mode", "static"]).decode_mode == "static"


def test_merging_into_a_tied_head_leaves_the_embedding_alone(qwen3_dir):
    net = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, local_files_only=True)
    assert net.get_output_embeddings().weight is net.get_input_embeddings().weight  # tied checkpoint
    emb = net.get_input_embeddings().weight.detach().clone()
    hf_model.untie_output_head(net)
    with torch.no_grad():
        net.get_output_embeddings().weight.add_(1.0)
    assert torch.equal(net.get_input_embeddings().weight, emb)


def test_gqa_decode_attention_equals_sdpa_with_repeated_kv():
    """The static decode step's attention (no K/V repeat) equals transformers' sdpa path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    R, H, Hkv, C, D = 3, 8, 2, 11, 16
    q, k, v = (torch.randn(R, h, n, D, generator=g) for h, n in ((H, 1), (Hkv, C), (Hkv, C)))
    mask = torch.rand(R, 1, 1, C, generator=g) > 0.4
    mask[:, :, :, 0] = True
    module = torch.nn.Module()
    module.num_key_value_groups = H // Hkv
    module.is_causal = True
    got, _ = decode_cache.gqa_decode_attention(module, q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (R, 1, H, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # A wrong head grouping (query head h on KV head h % Hkv) is detected.
    bad, _ = decode_cache.gqa_decode_attention(
        module, q.reshape(R, H // Hkv, Hkv, 1, D).transpose(1, 2).reshape(R, H, 1, D), k, v, mask, scaling=0.25
    )
    assert not torch.allclose(bad, want, atol=1e-3)


def test_a_checkpoint_without_a_tokenizer_builds_the_offline_one_on_first_use(qwen3_dir, tmp_path):
    """The offline tokenizer takes seconds to build; a server that never checks a stop string
    never builds it."""
    from dppo_harness.local_server.vocab import get_tokenizer

    e = Engine(tmp_path, model_path=qwen3_dir, device="cpu")
    try:
        assert "tokenizer" not in vars(e)  # not built at start
        assert e._decode_text([300, 301]) == get_tokenizer().decode([300, 301])
        assert vars(e)["tokenizer"] is get_tokenizer()
    finally:
        e.close()


def test_greedy_top_k_top_p_and_stop_strings(engine):
    base = "Qwen/Qwen3.5-2B"
    prompt = list(range(200, 212))

    def toks(**kw):
        args = dict(temperature=1.0, top_k=-1, top_p=1.0, stop_strings=[], seed=3) | kw
        out = engine.sample(
            base,
            prompt,
            2,
            6,
            args["temperature"],
            args["top_k"],
            args["top_p"],
            [],
            args["stop_strings"],
            args["seed"],
            False,
        )
        return [s.tokens for s in out], out

    greedy, _ = toks(temperature=0.0)
    assert greedy[0] == greedy[1]  # argmax: both samples identical
    assert toks(top_k=1)[0] == greedy and toks(top_p=1e-6, seed=9)[0] == greedy
    free, _ = toks(seed=4)
    assert free != greedy and toks(seed=4)[0] == free  # seeded Gumbel-max draws repeat
    text = engine._decode_text(free[0][:3])
    stop = text[-2:] if len(text) >= 2 else text
    cut, out = toks(seed=4, stop_strings=[stop])
    assert out[0].stop_reason == "stop" and len(cut[0]) <= 3 and cut[0] == free[0][: len(cut[0])]
    # ids the tokenizer cannot decode (embedding padding rows) are skipped, not fatal
    assert engine._decode_text([300, 10**7, 301]) == engine._decode_text([300, 301])
