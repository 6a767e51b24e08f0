"""Long-context retrieval prompts ("passkey"): real English text as the haystack, a random passkey planted at
a chosen depth, and a question about it.

The haystack is read at run time from licence texts every Debian machine has (/usr/share/common-licenses,
package base-files); nothing of it is stored in this repository. The prompt is built to a target length in
the model's own tokens, so the trace has the length asked for.
"""
import dataclasses
import os
import random
import re
from typing import Sequence

from .errors import CaptureError

LICENSE_DIR = "/usr/share/common-licenses"
# Long, plain-English texts; concatenated in this order until the haystack is long enough.
DEFAULT_HAYSTACK = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3")
QUESTION = "What is the passkey? Answer with the number only."
INTRO = ("There is a passkey hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the passkey.")


@dataclasses.dataclass
class PasskeyTask:
    """A passkey prompt. `user_message` is the whole user turn (intro, haystack with the needle, question);
    `question` is its last sentence (kvsim's `question` role starts there)."""
    user_message: str
    question: str
    passkey: str
    depth: float                 # requested relative position of the needle in the haystack, in [0, 1]
    needle: str
    haystack_files: tuple
    needle_char: int             # character offset of the needle in user_message

    def answered(self, generated_text: str) -> bool:
        """The task succeeds when the passkey appears in the generated text."""
        return self.passkey in re.sub(r"[\s,]", "", generated_text)

    def config_text(self) -> str:
        return ("passkey: %s\ndepth: %.4f\nhaystack: %s (%s)\nquestion: %r" %
                (self.passkey, self.depth, ",".join(self.haystack_files), LICENSE_DIR, self.question))


def _read_haystack(files: Sequence[str], license_dir: str) -> str:
    parts = []
    for name in files:
        path = os.path.join(license_dir, name)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise CaptureError("passkey haystack %s: cannot read (%s); it comes with Debian's base-files "
                               "package, or pass haystack_files= from another folder" % (path, e.strerror)) from e
        # One paragraph per blank-line block; whitespace inside a paragraph collapsed (the licence files are
        # hard-wrapped and indented).
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if para:
                parts.append(para)
    if not parts:
        raise CaptureError("passkey haystack %s: no text" % ", ".join(files))
    return parts


def build_passkey_task(count_tokens, target_tokens: int, depth: float, seed: int = 0,
                       haystack_files: Sequence[str] = DEFAULT_HAYSTACK, license_dir: str = LICENSE_DIR,
                       digits: int = 5) -> PasskeyTask:
    """Builds a passkey user message whose full prompt has about `target_tokens` tokens.

    count_tokens(user_message) -> the prompt length in tokens once the chat template is applied (the caller
    knows the tokenizer and template). The haystack is whole paragraphs of the licence texts, cut to fit;
    the needle goes between paragraphs at the boundary nearest `depth` (0 = first, 1 = last)."""
    if not 0.0 <= depth <= 1.0:
        raise CaptureError("passkey depth must be in [0, 1], got %g" % depth)
    if target_tokens < 64:
        raise CaptureError("passkey prompt length must be >= 64 tokens, got %d" % target_tokens)
    rng = random.Random(seed)
    passkey = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
    needle = "The passkey is %s. Remember it. %s is the passkey." % (passkey, passkey)
    paras = _read_haystack(haystack_files, license_dir)

    def message(k):
        body = paras[:k]
        at = int(round(depth * len(body)))
        text = " ".join(body[:at] + [needle] + body[at:])
        return "%s\n\n%s\n\n%s" % (INTRO, text, QUESTION)

    # Whole paragraphs: the largest count that fits (binary search on the token count).
    lo, hi = 0, len(paras)
    if count_tokens(message(hi)) <= target_tokens:
        raise CaptureError("passkey haystack too short: %d tokens of text in %s, %d asked; add haystack files"
                           % (count_tokens(message(hi)), ",".join(haystack_files), target_tokens))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(message(mid)) <= target_tokens:
            lo = mid
        else:
            hi = mid - 1
    # Then words of the next paragraph, to land close to the target.
    words = paras[lo].split()
    best = message(lo)
    wl, wh = 0, len(words)
    while wl < wh:
        mid = (wl + wh + 1) // 2
        cand_paras = paras[:lo] + [" ".join(words[:mid])]
        at = int(round(depth * len(cand_paras)))
        text = " ".join(cand_paras[:at] + [needle] + cand_paras[at:])
        cand = "%s\n\n%s\n\n%s" % (INTRO, text, QUESTION)
        if count_tokens(cand) <= target_tokens:
            wl, best = mid, cand
        else:
            wh = mid - 1
    return PasskeyTask(best, QUESTION, passkey, depth, needle, tuple(haystack_files), best.index(needle))
