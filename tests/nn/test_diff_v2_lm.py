"""DIFF V2 inside the decoder LM (``diffmm.models.lm``): built through ``LMConfig.attn_type='diff_v2'``."""
import pytest
import torch

lm = pytest.importorskip("diffmm.models.lm")


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_lm_diff_v2_kv_cache_decoding_equals_full_forward(n_kv_head):
    torch.manual_seed(0)
    cfg = lm.LMConfig(vocab_size=97, context_length=32, layers=2, width=64, heads=4, kv_heads=n_kv_head,
                      attn_type="diff_v2")
    model = lm.DiffLM(cfg).eval()
    attn = model.blocks[0].attn
    assert type(attn).__name__ == "DiffV2Attention" and attn.q_proj.out_features == 2 * 64
    idx = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        full = model(idx)
        caches = model.new_kv_caches(13)
        steps = [model(idx[:, :4], kv_caches=caches)]
        for t in range(4, 13):
            steps.append(model(idx[:, t:t + 1], kv_caches=caches, start_pos=t))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_lm_diff_v2_trains_and_counts_params():
    torch.manual_seed(0)
    kw = dict(vocab_size=97, context_length=32, layers=2, width=64, heads=4)
    v2 = lm.DiffLM(lm.LMConfig(attn_type="diff_v2", **kw))
    std = lm.DiffLM(lm.LMConfig(attn_type="standard", **kw))
    E, L = 64, 2
    assert v2.param_report()["attention"] - std.param_report()["attention"] == L * (E * E + E * 4)  # extra Q2 + lambda
    idx = torch.randint(0, 97, (2, 16))
    opt = torch.optim.AdamW(v2.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        _, loss = v2(idx, idx.roll(-1, 1))
        opt.zero_grad()
        loss.backward()
        assert v2.blocks[1].attn.lambda_proj.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
