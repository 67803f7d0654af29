"""The pooled encoders run the last block's MLP on the pooled token alone (CLS of the image, EOT of the text):
features and every parameter gradient equal those of the full-token computation, in float64."""
import pytest
import torch
import torch.nn.functional as F

import diffmm


def _full_tokens(model, images, text):
    """Both towers the long way: every token through every block, then pooling."""
    img = model.visual.pool(model.visual.forward_features(images)) @ model.image_projection
    x = model.token_embedding(text) + model.positional_embedding[:text.shape[1]]
    for blk in model.transformer.resblocks:
        x = blk(x)
    txt = model.ln_final(x)[torch.arange(len(text)), text.argmax(dim=-1)] @ model.text_projection
    return img, txt


def _pooled_rows(model, images, text):
    return model.encode_image(images), model.encode_text(text)


@pytest.mark.parametrize("name", ["DiffCLIP-Tiny", "CLIP-Tiny"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_pooled_rows_equal_full_tokens(name, checkpointing):
    torch.manual_seed(0)
    model = diffmm.create_model(name).double().train()
    model.set_grad_checkpointing(checkpointing)
    v, t = model.config.vision_cfg, model.config.text_cfg
    images = torch.randn(3, 3, v.image_size, v.image_size, dtype=torch.float64)
    text = torch.randint(1, 400, (3, t.context_length))
    text[torch.arange(3), torch.tensor([4, 9, t.context_length - 1])] = 49407  # EOT at different positions
    results = []
    for fn in (_full_tokens, _pooled_rows):
        img, txt = fn(model, images, text)
        loss = (F.normalize(img, dim=-1) @ F.normalize(txt, dim=-1).T).square().sum()
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        results.append((img, txt, grads))
    (img_a, txt_a, g_a), (img_b, txt_b, g_b) = results
    torch.testing.assert_close(img_b, img_a, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(txt_b, txt_a, atol=1e-12, rtol=1e-10)
    names = [n for n, _ in model.named_parameters()]
    for n, a, b in zip(names, g_a, g_b):
        if a is None:
            assert b is None or not b.any(), n
            continue
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-9, msg=lambda m, n=n: f"grad {n}: {m}")
