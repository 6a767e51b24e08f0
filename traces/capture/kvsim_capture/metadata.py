"""Per-token metadata of a capture (docs/trace-format.md, /tokens): modality from the model's special token
ids, one segment per image / video frame / text span, patch row and column from the processor's grid sizes,
roles from the chat-template spans, RoPE position ids (multi-axis ones kept as an extension)."""
import dataclasses
import math
from typing import Optional, Sequence, Tuple

import numpy as np

from .errors import CaptureError

TEXT, IMAGE, VIDEO, OTHER = 0, 1, 2, 3
SYSTEM, CONTEXT, QUESTION, GENERATED = 0, 1, 2, 3


@dataclasses.dataclass
class TokenMetadata:
    modality: np.ndarray
    segment_id: np.ndarray
    patch_row: np.ndarray
    patch_col: np.ndarray
    position_id: np.ndarray
    role: np.ndarray
    token_id: np.ndarray
    text: Optional[Sequence[str]] = None
    position_ids_multi: Optional[np.ndarray] = None  # [axes, T] when the model uses multi-axis RoPE

    def as_dict(self):
        return dataclasses.asdict(self)


def _runs(mask):
    """[start, end) of each maximal run of True in a 1-D bool array."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[0::2], edges[1::2]))


def _place_grids(positions, grids, frames, patch_row, patch_col, unit_of):
    """Assigns the visual tokens at `positions` (in order) to grids: `grids` is a list of (rows, cols) per
    image, or (frames, rows, cols) per video (each frame its own unit; one extra trailing video token, as
    LLaVA-OneVision's newline, joins the last frame). An image entry may be a plain token count instead of a
    grid (any-res layouts such as LLaVA-OneVision's, with newline tokens): one unit, patch positions -1.
    Returns False when the token count does not match: patch positions are then left -1 and each contiguous
    run becomes one unit."""
    sizes = []  # per unit (tokens, cols); cols 0: no patch positions
    for g in grids:
        if np.ndim(g) == 0:
            sizes.append((int(g), 0))
            continue
        g = tuple(int(x) for x in g)
        f, r, c = (1,) + g if len(g) == 2 else g
        if frames:
            sizes += [(r * c, c)] * f   # one unit per frame
        else:
            sizes.append((f * r * c, c))
    placed = sum(k for k, _ in sizes)
    if placed == len(positions) - 1 and frames and sizes:
        # LLaVA-OneVision's newline token after a video's frames: the last frame's unit, no patch position.
        unit_of[positions[-1]] = len(sizes) - 1
    elif placed != len(positions):
        return False
    k = 0
    for u, (count, c) in enumerate(sizes):
        for i in range(count):
            p = positions[k]
            if c:
                patch_row[p], patch_col[p] = i // c, i % c
            unit_of[p] = u
            k += 1
    return True


def build_token_metadata(prompt_ids, decode_ids=(), *, image_token_id=None, video_token_id=None,
                         image_grids=None, video_grids=None, question_span: Optional[Tuple[int, int]] = None,
                         system_end: Optional[int] = None, position_ids=None, text=None) -> TokenMetadata:
    """prompt_ids: the n prompt token ids as the model saw them (image/video placeholders expanded);
    decode_ids: the token fed at each decode step (generated tokens except the last).
    image_grids: per image, its LLM-token grid (rows, cols) (e.g. Qwen2-VL: image_grid_thw // merge; LLaVA-1.5:
    (24, 24)) or its token count without a grid (LLaVA-OneVision: one unit, no patch positions); video_grids:
    per video, (frames, rows, cols). Without grids, each contiguous run of image tokens is one image (square
    runs get row-major patch positions) and each run of video tokens one segment without patch positions.
    question_span: [start, end) of the user's question text; everything after it in the prompt (the
    assistant header) is tagged question too. Default: the text tokens after the last visual token.
    system_end: tokens [0, system_end) are system (template preamble, system prompt). Default: the first
    visual token, or 0 for a text-only prompt. The rest of the prompt is context.
    position_ids: [T] or [axes, T] RoPE position ids (default 0..T-1); for multi-axis ids /tokens/position_id
    holds axis 0 (temporal) and all axes are kept in position_ids_multi."""
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    dec = np.asarray(decode_ids, dtype=np.int64).reshape(-1)
    n, t = len(prompt), len(prompt) + len(dec)
    if n == 0:
        raise CaptureError("the prompt is empty")
    token_id = np.concatenate([prompt, dec])
    modality = np.zeros(t, np.uint8)
    if image_token_id is not None:
        modality[:n][np.isin(prompt, np.atleast_1d(image_token_id))] = IMAGE
    if video_token_id is not None:
        modality[:n][np.isin(prompt, np.atleast_1d(video_token_id))] = VIDEO
    patch_row = np.full(t, -1, np.int32)
    patch_col = np.full(t, -1, np.int32)
    unit = np.full(t, -1, np.int64)  # image / frame index, distinct across modalities via an offset
    for code, grids, frames, offset in ((IMAGE, image_grids, False, 0), (VIDEO, video_grids, True, 1 << 40)):
        positions = np.flatnonzero(modality == code)
        if len(positions) == 0:
            continue
        sub_unit = np.full(t, -1, np.int64)
        placed = grids is not None and _place_grids(positions, grids, frames, patch_row, patch_col, sub_unit)
        if not placed:
            for u, (a, b) in enumerate(_runs(modality == code)):
                sub_unit[a:b] = u
                side = math.isqrt(b - a)
                if code == IMAGE and side * side == b - a:
                    patch_row[a:b] = np.arange(b - a) // side
                    patch_col[a:b] = np.arange(b - a) % side
        unit[positions] = sub_unit[positions] + offset

    visual = np.flatnonzero(modality[:n] != TEXT)
    if question_span is None:
        q0 = visual[-1] + 1 if len(visual) else 0
        question_span = (q0, n)
    q0, q1 = int(question_span[0]), int(question_span[1])
    if not 0 <= q0 <= q1 <= n:
        raise CaptureError("question span %s is outside the %d-token prompt" % ((q0, q1), n))
    if system_end is None:
        system_end = int(visual[0]) if len(visual) else 0
    system_end = min(int(system_end), q0)
    role = np.full(t, CONTEXT, np.uint8)
    role[:system_end] = SYSTEM
    role[q0:n] = QUESTION
    role[n:] = GENERATED

    # A new segment starts wherever the modality, role or image/frame changes (text spans included).
    segment_id = np.zeros(t, np.int32)
    seg = 0
    for i in range(1, t):
        if modality[i] != modality[i - 1] or role[i] != role[i - 1] or unit[i] != unit[i - 1]:
            seg += 1
        segment_id[i] = seg

    multi = None
    if position_ids is None:
        pos = np.arange(t, dtype=np.int64)
    else:
        p = np.asarray(position_ids, dtype=np.int64)
        if p.ndim == 1:
            p = p[None]
        if p.shape[-1] != t:
            raise CaptureError("position ids cover %d tokens, expected %d" % (p.shape[-1], t))
        pos = p[0].copy()
        if p.shape[0] > 1:
            multi = p
    if text is not None and len(text) != t:
        raise CaptureError("token text has %d entries, expected %d" % (len(text), t))
    return TokenMetadata(modality=modality, segment_id=segment_id, patch_row=patch_row, patch_col=patch_col,
                         position_id=pos, role=role, token_id=token_id, text=text, position_ids_multi=multi)
