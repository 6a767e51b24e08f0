"""Dataset mode of the capture tool: the manifest `kvsim sweep --manifest` reads (docs/cli.md "Manifest").

hf.capture_dataset captures many prompts with one model load and keeps DIR/manifest.csv up to date after
every trace (rewritten atomically, so an interrupted dataset leaves a manifest of the traces that are
complete). Each line: id, the trace's path relative to DIR, the item's tags and the trace's group (its model
name and shape, read back from the written trace), so kvsim refuses a trace that does not belong.
"""
import os
import re

from .errors import CaptureError

MANIFEST = "manifest.csv"
HEADER = "id,path,tags,group"
_ID = re.compile(r"^[A-Za-z0-9._-]+$")


def trace_group(path):
    """"MODEL L=layers H=heads KV=kv_heads D=head_dim" of a trace file, as kvsim names its group."""
    import h5py  # noqa: PLC0415

    with h5py.File(path, "r") as f:
        a = f.attrs
        name = a["model_name"]
        name = name.decode("utf-8") if isinstance(name, bytes) else str(name)
        if not name or any(c.isspace() or c in ',"' for c in name):
            return ""  # a name a manifest field cannot hold: no declared group (kvsim still groups by it)
        return "%s L=%d H=%d KV=%d D=%d" % (name, int(a["num_layers"]), int(a["num_heads"]),
                                             int(a["num_kv_heads"]), int(a["head_dim"]))


def item_tags(item):
    """An item's tags ({"task": "qa"} or ["task=qa"]) as "k=v;k=v"; a tag kvsim could not read back raises."""
    tags = item.get("tags") or {}
    pairs = ["%s=%s" % (k, v) for k, v in tags.items()] if isinstance(tags, dict) else [str(t) for t in tags]
    for t in pairs:
        k, eq, v = t.partition("=")
        if not k or not eq or any(c in t for c in ',;"\n') or t != t.strip():
            raise CaptureError("item '%s': tag %r must be key=value without ',', ';', '\"' or surrounding "
                               "spaces" % (item.get("id"), t))
    return ";".join(pairs)


def check_items(items):
    """Every item checked before any capture: an id kvsim accepts (letters, digits, '.', '_', '-'), unique,
    a prompt, readable tags."""
    seen = set()
    for n, item in enumerate(items):
        ident = item.get("id") if isinstance(item, dict) else None
        if not isinstance(ident, str) or not _ID.match(ident):
            raise CaptureError("item %d: id %r must be non-empty letters, digits, '.', '_' or '-' (it names "
                               "the trace file and the manifest line)" % (n, ident))
        if ident in seen:
            raise CaptureError("item %d: duplicate id '%s'; give every item its own id" % (n, ident))
        seen.add(ident)
        if not item.get("prompt"):
            raise CaptureError("item '%s': no 'prompt'" % ident)
        item_tags(item)


def write_manifest(out_dir, rows):
    """DIR/manifest.csv from rows (id, trace path, tags "k=v;k=v", group), written to a temporary name and
    renamed. Paths are written relative to DIR (kvsim resolves them against the manifest's folder)."""
    lines = ["# written by kvsim_capture (dataset mode); kvsim sweep --manifest reads it", HEADER]
    for ident, path, tags, group in rows:
        rel = os.path.relpath(path, out_dir)
        if "," in rel or '"' in rel:
            raise CaptureError("trace path %r holds ',' or '\"', which a manifest cannot" % rel)
        lines.append("%s,%s,%s,%s" % (ident, rel, tags, group))
    path = os.path.join(out_dir, MANIFEST)
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path
