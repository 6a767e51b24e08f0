"""Writes kvsim trace format v1 (docs/trace-format.md) with h5py, layer by layer, to a temporary file that
is renamed into place only when complete: a file under its final name is always a complete trace."""
import gc
import os
import sys

import h5py
import numpy as np

from .errors import CaptureError

FORMAT_NAME = "kvsim-trace"
FORMAT_VERSION = 1
MODALITY_NAMES = "text,image,video,other"
ROLE_NAMES = "system,context,question,generated"
STORAGE_DTYPES = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4")}
FLOAT16_MAX = 65504.0

# Root attributes the C++ reader requires, with the Python type they are written as.
_INT_ATTRS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "causal", "sliding_window",
              "prefill_length", "num_decode_steps")
_REAL_ATTRS = ("softmax_scale", "logit_softcap", "rope_theta")
_STR_ATTRS = ("model_name", "model_family", "model_dtype", "storage_dtype", "source", "generator",
              "generator_version")
# The file format kvsim's C++ reader (HDF5 1.10) understands, with checksummed metadata (superblock v3,
# object headers v2): docs/trace-format.md, "Integrity".
LIBVER = ("v110", "v110")


def fixed_string(value):
    """A str as a fixed-length UTF-8 HDF5 string: never a variable-length one, whose bytes live in HDF5's
    global heap outside every checksum (docs/trace-format.md, "Integrity")."""
    b = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return np.array(b, dtype=h5py.string_dtype("utf-8", max(1, len(b))))


def set_attr(obj, name, value):
    """obj.attrs[name] = value, strings fixed-length."""
    if isinstance(value, (str, bytes)):
        obj.attrs.create(name, fixed_string(value))
    else:
        obj.attrs[name] = value


def attr_str(value):
    """An HDF5 string attribute as str, whether stored fixed-length (bytes) or variable-length (str)."""
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8")
    return str(value)


def create_dataset(group, name, data=None, shape=None, dtype=None, chunks=None):
    """group.create_dataset with what every dataset of a trace has: a Fletcher32 checksum on every chunk
    (one chunk per leading index unless `chunks` says otherwise). Empty datasets cannot be chunked."""
    if data is not None:
        data = np.asarray(data) if dtype is None else np.asarray(data, dtype=dtype)
        shape, dtype = data.shape, data.dtype
    if int(np.prod(shape)) == 0:
        return group.create_dataset(name, shape=shape, dtype=dtype, data=data)
    if chunks is None:
        chunks = tuple([1] * (len(shape) - 1) + [int(shape[-1])]) if len(shape) > 1 else tuple(int(x) for x in shape)
    return group.create_dataset(name, shape=shape, dtype=dtype, data=data, chunks=chunks, fletcher32=True)


class TraceWriter:
    """Streams one trace to `path`: begin() writes metadata, write_layer() one layer at a time in order,
    finish() closes and renames. Used as a context manager, an exception before finish() deletes the
    temporary file (`<path>.tmp.<pid>`, the same name kvsim's C++ writer uses)."""

    def __init__(self, path, chunk_tokens=1024):
        self.path = os.fspath(path)
        self.tmp_path = "%s.tmp.%d" % (self.path, os.getpid())
        self.chunk_tokens = chunk_tokens
        self._file = None
        self._next_layer = 0
        self._meta = None
        self._finished = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self._finished:
            self.abort()
        return False

    def abort(self):
        # After a failed write (full disk) HDF5 objects fail again as they are freed; those errors are
        # reported as "Exception ignored" tracebacks on stderr. The first error already went to the caller,
        # so they are silenced while the file is closed and its objects collected.
        hook, sys.unraisablehook = sys.unraisablehook, lambda _unraisable: None
        try:
            if self._file is not None:
                try:
                    self._file.close()
                except Exception:  # noqa: BLE001 - best effort while unwinding
                    pass
                self._file = None
            gc.collect()
        finally:
            sys.unraisablehook = hook
        if os.path.exists(self.tmp_path):
            os.remove(self.tmp_path)

    def begin(self, attrs, tokens, query_positions, prompt_entropy_regions=None):
        """attrs: the root attributes of docs/trace-format.md (format, version, query_mode and seed are
        filled in); tokens: dict of per-token arrays (modality, segment_id, patch_row, patch_col,
        position_id, role, token_id, optional text); query_positions: ascending int array;
        prompt_entropy_regions: the region ends of recorded prompt entropies (entropies.regions), or None
        for none; with it every write_layer() needs its prompt_entropies."""
        for k in _INT_ATTRS + _REAL_ATTRS + _STR_ATTRS:
            if k not in attrs:
                raise CaptureError("%s: internal: root attribute '%s' missing" % (self.path, k))
        if attrs["storage_dtype"] not in STORAGE_DTYPES:
            raise CaptureError("%s: storage_dtype must be float16 or float32, got '%s'"
                               % (self.path, attrs["storage_dtype"]))
        n, steps = int(attrs["prefill_length"]), int(attrs["num_decode_steps"])
        t = n + steps
        qpos = np.asarray(query_positions, dtype=np.int32)
        folder = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(folder):
            raise CaptureError("%s: folder '%s' does not exist" % (self.path, folder))
        try:
            self._file = h5py.File(self.tmp_path, "w", libver=LIBVER, track_order=False)
        except OSError as e:
            raise CaptureError("%s: cannot create '%s' (%s); check that the folder is writable"
                               % (self.path, self.tmp_path, e)) from e
        f = self._file
        set_attr(f, "format", FORMAT_NAME)
        f.attrs["format_version"] = np.int64(FORMAT_VERSION)
        for k in _INT_ATTRS:
            f.attrs[k] = np.int64(attrs[k])
        for k in _REAL_ATTRS:
            f.attrs[k] = np.float64(attrs[k])
        for k in _STR_ATTRS:
            set_attr(f, k, str(attrs[k]))
        f.attrs["seed"] = np.uint64(attrs.get("seed", 0))
        set_attr(f, "query_mode", "all" if len(qpos) == t else "window_and_decode")
        f.attrs["has_prefill_column_sums"] = np.int64(1 if attrs.get("has_prefill_column_sums") else 0)
        if attrs.get("config_text"):
            set_attr(f, "config_text", str(attrs["config_text"]))
        tk = f.create_group("tokens")
        spec = (("modality", "<u1"), ("segment_id", "<i4"), ("patch_row", "<i4"), ("patch_col", "<i4"),
                ("position_id", "<i8"), ("role", "<u1"), ("token_id", "<i8"))
        for name, dt in spec:
            arr = np.asarray(tokens[name]).astype(dt)
            if arr.shape != (t,):
                raise CaptureError("%s: internal: tokens/%s has shape %s, expected (%d,)"
                                   % (self.path, name, arr.shape, t))
            create_dataset(tk, name, data=arr)
        create_dataset(tk, "phase", data=(np.arange(t) >= n).astype("<u1"))
        set_attr(tk["modality"], "names", MODALITY_NAMES)
        set_attr(tk["role"], "names", ROLE_NAMES)
        if tokens.get("text") is not None:
            text = [str(s).encode("utf-8") for s in tokens["text"]]
            create_dataset(tk, "text", data=np.array(text, dtype=h5py.string_dtype(
                "utf-8", max([1] + [len(b) for b in text]))))
        create_dataset(f.create_group("queries"), "positions", data=qpos)
        f.create_group("layers")
        regions = None
        if prompt_entropy_regions is not None:
            from . import entropies  # noqa: PLC0415 - needs kvsim's extension, only when recording them
            regions = np.asarray(prompt_entropy_regions, dtype=np.int32)
            # The reader's region rules, checked with an all-zero (valid) layer.
            entropies.check(np.zeros((len(regions), 3, int(attrs["num_heads"]))), regions, attrs["num_heads"], n,
                            "%s: prompt_entropy_regions" % self.path)
        if attrs.get("has_prefill_column_sums") or regions is not None:
            f.create_group("aggregates")
        if regions is not None:
            create_dataset(f["aggregates"], "prompt_entropy_regions", data=regions.astype("<i4"))
        self._meta = dict(attrs, t=t, tq=len(qpos), prompt_entropy_regions=regions)

    def _tensor(self, group, name, data, heads, rows):
        m = self._meta
        d = int(m["head_dim"])
        dtype = STORAGE_DTYPES[m["storage_dtype"]]
        if tuple(data.shape) != (heads, rows, d):
            raise CaptureError("%s: internal: %s/%s has shape %s, expected %s"
                               % (self.path, group.name, name, tuple(data.shape), (heads, rows, d)))
        chunks = (1, max(1, min(rows, self.chunk_tokens)), d)
        ds = create_dataset(group, name, shape=(heads, rows, d), dtype=dtype, chunks=chunks)
        for h in range(heads):  # one head at a time: bounded host memory when `data` is a memmap
            ds[h] = np.asarray(data[h], dtype=dtype)

    def write_layer(self, layer, keys, values, queries, prefill_column_sums=None, prompt_entropies=None):
        """prompt_entropies: [regions, 3, num_heads] float64, exactly when begin() had prompt_entropy_regions;
        checked as kvsim's reader checks them (shape, every value in [0, log ce])."""
        m = self._meta
        if m is None or layer != self._next_layer or layer >= m["num_layers"]:
            raise CaptureError("%s: internal: layers must be written in order after begin(); expected %d, got %d"
                               % (self.path, self._next_layer, layer))
        g = self._file["layers"].create_group("layer_%03d" % layer)
        self._tensor(g, "keys", keys, m["num_kv_heads"], m["t"])
        self._tensor(g, "values", values, m["num_kv_heads"], m["t"])
        self._tensor(g, "queries", queries, m["num_heads"], m["tq"])
        if m.get("has_prefill_column_sums"):
            s = np.asarray(prefill_column_sums, dtype="<f4")
            if s.shape != (m["num_heads"], m["prefill_length"]):
                raise CaptureError("%s: internal: prefill_column_sums shape %s" % (self.path, s.shape))
            create_dataset(self._file["aggregates"].require_group("layer_%03d" % layer), "prefill_column_sums",
                           data=s)
        regions = m["prompt_entropy_regions"]
        if (prompt_entropies is None) != (regions is None):
            raise CaptureError("%s: internal: layer %d %s prompt_entropies but begin() %s prompt_entropy_regions; "
                               "every layer must have them, or none" % (
                                   self.path, layer, "lacks" if prompt_entropies is None else "has",
                                   "was given" if regions is not None else "had no"))
        if regions is not None:
            from . import entropies  # noqa: PLC0415
            e = entropies.check(prompt_entropies, regions, m["num_heads"], m["prefill_length"],
                                "%s: layer %d" % (self.path, layer))
            create_dataset(self._file["aggregates"].require_group("layer_%03d" % layer), "prompt_entropies",
                           data=e.astype("<f8"))
        self._next_layer += 1

    def write_extra(self, name, data, attrs=None, chunks=None):
        """Writes an optional dataset outside the v1 layout (e.g. 'capture/position_ids'); kvsim ignores it."""
        ds = create_dataset(self._file, name, data=data, chunks=chunks)
        for k, v in (attrs or {}).items():
            set_attr(ds, k, v)
        return ds

    def extra_group(self, name):
        return self._file.require_group(name)

    def finish(self):
        m = self._meta
        if m is None or self._next_layer != m["num_layers"]:
            raise CaptureError("%s: internal: finish() after %d of %s layers"
                               % (self.path, self._next_layer, m and m["num_layers"]))
        self._file.close()
        self._file = None
        os.replace(self.tmp_path, self.path)
        self._finished = True
