#include "traces/hdf5_trace.h"

#include <fcntl.h>
#include <hdf5.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "sim/cpu.h"
#include "sim/parallel.h"
#include "sim/resources.h"
#include "sim/sanitizers.h"
#include "traces/half.h"
#include "traces/mapped_file.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvsim {
namespace {

static_assert(sizeof(hid_t) == sizeof(long long), "hid_t is stored as long long in hdf5_trace.h");
static_assert(std::endian::native == std::endian::little, "raw fp16 I/O and HashFile assume little-endian");

constexpr const char kModalityNames[] = "text,image,video,other";
constexpr const char kRoleNames[] = "system,context,question,generated";
constexpr const char kSeeDocs[] = "see docs/trace-format.md";

// Owns one HDF5 identifier and closes it with the matching H5?close.
class Hid {
 public:
  Hid() = default;
  Hid(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Hid(Hid&& o) noexcept : id_(std::exchange(o.id_, -1)), close_(o.close_) {}
  Hid& operator=(Hid&& o) noexcept {
    std::swap(id_, o.id_);
    std::swap(close_, o.close_);
    return *this;
  }
  ~Hid() {
    if (id_ >= 0) close_(id_);
  }
  operator hid_t() const { return id_; }  // NOLINT: used directly as an hid_t argument
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

// Error stacks and their printing are per thread in a thread-safe HDF5, so every entry point calls this.
void SilenceHdf5Errors() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

// fork() while another thread is inside HDF5 would give the guarded child (GuardedProbe) a copy of HDF5's
// global lock that nobody will release: the child hangs until the guard's timeout and a good trace is
// reported as damaged. That happens when threads of one process open and read traces at once (the Python
// package runs replays from several threads). So every public entry point that calls HDF5 holds this lock
// shared (re-entrantly per thread), and the fork holds it exclusively. HDF5 serialises its own calls anyway,
// so readers lose no concurrency.
// Writer-preferring (a waiting fork blocks new readers, so threads that read in a loop cannot starve it);
// never taken recursively (hdf5_use_depth), which that kind of lock requires.
pthread_rwlock_t* Hdf5ForkLock() {
  static pthread_rwlock_t* lock = [] {
    static pthread_rwlock_t l;
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&l, &attr);
    pthread_rwlockattr_destroy(&attr);
    return &l;
  }();
  return lock;
}
thread_local int hdf5_use_depth = 0;
class Hdf5Use {
 public:
  Hdf5Use() {
    if (hdf5_use_depth++ == 0) pthread_rwlock_rdlock(Hdf5ForkLock());
  }
  ~Hdf5Use() {
    if (--hdf5_use_depth == 0) pthread_rwlock_unlock(Hdf5ForkLock());
  }
  Hdf5Use(const Hdf5Use&) = delete;
  Hdf5Use& operator=(const Hdf5Use&) = delete;
};

// The innermost message on this thread's HDF5 error stack, as " (HDF5: ...)", then clears the stack.
std::string Hdf5Detail() {
  std::string msg;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* e, void* out) -> herr_t {
        if (n == 0 && e->desc) *static_cast<std::string*>(out) = e->desc;
        return 0;
      },
      &msg);
  H5Eclear2(H5E_DEFAULT);
  // The file drivers' messages span lines and list buffers and offsets; keep what names the cause.
  if (const size_t at = msg.find("error message = '"); at != std::string::npos) {
    const size_t begin = at + 17, end = msg.find('\'', begin);
    msg =
        msg.substr(0, msg.find(':')) + ": " + msg.substr(begin, end == std::string::npos ? end : end - begin);
  }
  std::replace(msg.begin(), msg.end(), '\n', ' ');
  return msg.empty() ? "" : " (HDF5: " + msg + ")";
}

// The library's exit handler would close files left open and, after a close that failed (a full disk),
// crash on the half-closed file. Every file kvsim opens is closed explicitly, so the handler is turned off
// before the first HDF5 call.
[[maybe_unused]] const bool kNoHdf5AtExit = H5dont_atexit() >= 0;

Status ReadError(const std::string& what) {
  const std::string detail = Hdf5Detail();
  if (detail.find("checksum") != std::string::npos)
    return Status::DataLoss(what + " fails its checksum" + detail +
                            ": the file is damaged; copy it again or re-write it");
  return Status::DataLoss("cannot read " + what + detail + "; the file may be truncated or corrupt");
}
Status WriteError(const std::string& what) {
  return Status::Internal("cannot write " + what + Hdf5Detail() + "; check free disk space and permissions");
}

std::string LayerName(const char* group, int layer) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s/layer_%03d", group, layer);
  return buf;
}

std::string DimsString(const std::vector<hsize_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// IEEE binary16, little-endian (HDF5 1.10 has no predefined H5T_IEEE_F16LE; this is what h5py builds).
Hid HalfType() {
  Hid t(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  if (t.ok() && (H5Tset_fields(t, 15, 10, 5, 0, 10) < 0 || H5Tset_size(t, 2) < 0 || H5Tset_ebias(t, 15) < 0))
    return Hid();
  return t;
}

bool IsHalf(hid_t type) {
  size_t spos, epos, esize, mpos, msize;
  return H5Tget_class(type) == H5T_FLOAT && H5Tget_size(type) == 2 && H5Tget_order(type) == H5T_ORDER_LE &&
         H5Tget_fields(type, &spos, &epos, &esize, &mpos, &msize) >= 0 && spos == 15 && epos == 10 &&
         esize == 5 && mpos == 0 && msize == 10 && H5Tget_ebias(type) == 15;
}

// Index of the first value that rounds beyond the float16 range (|x| >= 65520), or -1.
int64_t FirstBeyondHalf(const std::vector<float>& v) {
  auto beyond = [](float x) { return (std::bit_cast<uint32_t>(x) & 0x7fffffff) >= 0x477ff000; };
  bool any = false;
  for (float x : v) any |= beyond(x);  // branch-free, vectorizes
  if (!any) return -1;
  return std::find_if(v.begin(), v.end(), beyond) - v.begin();
}

// Fixed-length UTF-8 strings of `size` bytes, null-padded: the writer stores every string this way, so a
// reader never touches HDF5's global heap (variable-length strings live there, outside the checksums).
Hid FixedUtf8StringType(size_t size) {
  Hid t(H5Tcopy(H5T_C_S1), H5Tclose);
  if (t.ok() && (H5Tset_size(t, std::max<size_t>(size, 1)) < 0 || H5Tset_strpad(t, H5T_STR_NULLPAD) < 0 ||
                 H5Tset_cset(t, H5T_CSET_UTF8) < 0))
    return Hid();
  return t;
}

// ---------------------------------------------------------------------------------------------- reading

Status OpenRootAttr(hid_t file, const char* name, Hid* attr) {
  const htri_t exists = H5Aexists(file, name);
  if (exists < 0) return ReadError(std::string("root attribute '") + name + "'");
  if (exists == 0)
    return Status::InvalidArgument(std::string("missing root attribute '") + name +
                                   "'; the file is not a complete kvsim trace v1 (" + kSeeDocs + ")");
  *attr = Hid(H5Aopen(file, name, H5P_DEFAULT), H5Aclose);
  Hid space(H5Aget_space(*attr), H5Sclose);
  if (!attr->ok() || !space.ok()) return ReadError(std::string("root attribute '") + name + "'");
  if (H5Sget_simple_extent_npoints(space) != 1)
    return Status::InvalidArgument(std::string("root attribute '") + name + "' must be a scalar (" +
                                   kSeeDocs + ")");
  return Status::Ok();
}

// Reads a scalar numeric root attribute through `mem_type`; integers only unless `allow_float`.
Status ReadNumberAttr(hid_t file, const char* name, hid_t mem_type, bool allow_float, void* out) {
  Hid attr;
  KVSIM_RETURN_IF_ERROR(OpenRootAttr(file, name, &attr));
  Hid type(H5Aget_type(attr), H5Tclose);
  const H5T_class_t cls = type.ok() ? H5Tget_class(type) : H5T_NO_CLASS;
  if (cls != H5T_INTEGER && !(allow_float && cls == H5T_FLOAT))
    return Status::InvalidArgument(std::string("root attribute '") + name + "' must be " +
                                   (allow_float ? "a number" : "an integer") + " (" + kSeeDocs + ")");
  if (H5Aread(attr, mem_type, out) < 0) return ReadError(std::string("root attribute '") + name + "'");
  return Status::Ok();
}

Status ReadAttr(hid_t file, const char* name, double* out) {
  return ReadNumberAttr(file, name, H5T_NATIVE_DOUBLE, true, out);
}
Status ReadAttr(hid_t file, const char* name, uint64_t* out) {
  return ReadNumberAttr(file, name, H5T_NATIVE_UINT64, false, out);
}
Status ReadAttr(hid_t file, const char* name, int* out) {
  long long v = 0;
  KVSIM_RETURN_IF_ERROR(ReadNumberAttr(file, name, H5T_NATIVE_LLONG, false, &v));
  if (v < INT_MIN || v > INT_MAX)
    return Status::InvalidArgument(std::string("root attribute '") + name + "' = " + std::to_string(v) +
                                   " is out of range");
  *out = static_cast<int>(v);
  return Status::Ok();
}
Status ReadAttr(hid_t file, const char* name, bool* out) {
  int v = 0;
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, name, &v));
  if (v != 0 && v != 1)
    return Status::InvalidArgument(std::string("root attribute '") + name + "' must be 0 or 1");
  *out = v == 1;
  return Status::Ok();
}

bool IsUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (int k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return false;
    i += len;
  }
  return true;
}

// Reads `n` strings from an attribute or dataset `obj` (fixed- or variable-length, any padding).
Status ReadStrings(hid_t obj, bool is_attr, size_t n, const std::string& what,
                   std::vector<std::string>* out) {
  Hid type(is_attr ? H5Aget_type(obj) : H5Dget_type(obj), H5Tclose);
  if (!type.ok()) return ReadError(what);
  if (H5Tget_class(type) != H5T_STRING)
    return Status::InvalidArgument(what + " must hold strings (" + kSeeDocs + ")");
  const htri_t vlen = H5Tis_variable_str(type);
  Hid mem(H5Tcopy(type), H5Tclose);
  if (vlen < 0 || !mem.ok() || (vlen == 0 && H5Tset_strpad(mem, H5T_STR_NULLPAD) < 0)) return ReadError(what);
  auto read = [&](void* buf) {
    return is_attr ? H5Aread(obj, mem, buf) : H5Dread(obj, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf);
  };
  out->resize(n);
  if (vlen) {
    std::vector<char*> ptrs(n, nullptr);
    if (read(ptrs.data()) < 0) return ReadError(what);
    for (size_t i = 0; i < n; ++i) (*out)[i] = ptrs[i] ? ptrs[i] : "";
    for (char* p : ptrs) H5free_memory(p);
  } else {
    const size_t size = H5Tget_size(type);
    std::vector<char> buf(n * size);
    if (read(buf.data()) < 0) return ReadError(what);
    for (size_t i = 0; i < n; ++i) (*out)[i].assign(&buf[i * size], strnlen(&buf[i * size], size));
  }
  for (const std::string& v : *out)
    if (!IsUtf8(v)) return Status::DataLoss(what + " is not valid UTF-8 text; the file is damaged");
  return Status::Ok();
}

Status ReadAttr(hid_t file, const char* name, std::string* out) {
  Hid attr;
  KVSIM_RETURN_IF_ERROR(OpenRootAttr(file, name, &attr));
  std::vector<std::string> v;
  KVSIM_RETURN_IF_ERROR(ReadStrings(attr, true, 1, std::string("root attribute '") + name + "'", &v));
  *out = std::move(v[0]);
  return Status::Ok();
}

// Optional attributes keep *out unchanged when absent.
template <typename T>
Status ReadOptionalAttr(hid_t file, const char* name, T* out) {
  const htri_t exists = H5Aexists(file, name);
  if (exists < 0) return ReadError(std::string("root attribute '") + name + "'");
  return exists ? ReadAttr(file, name, out) : Status::Ok();
}

// Whether every component of the absolute path `name` exists; a group that cannot be read (a failed
// checksum) is an error, not a missing link.
StatusOr<bool> LinkExists(hid_t file, const std::string& name) {
  for (size_t pos = name.find('/', 1);; pos = name.find('/', pos + 1)) {
    const std::string prefix = name.substr(0, pos);
    const htri_t exists = H5Lexists(file, prefix.c_str(), H5P_DEFAULT);
    if (exists < 0) return ReadError("group of '" + prefix + "'");
    if (exists == 0) return false;
    if (pos == std::string::npos) return true;
  }
}

// A numeric dataset whose stored bytes cannot hold its shape (unallocated chunks of a damaged or hand-made
// file: a 45 KB file can declare terabytes) is refused before anything is allocated for it. Compressed
// datasets may expand up to deflate's maximum ratio (1032:1).
Status CheckStored(hid_t ds, const std::string& name, const std::vector<hsize_t>& dims) {
  Hid type(H5Dget_type(ds), H5Tclose);
  Hid dcpl(H5Dget_create_plist(ds), H5Pclose);
  if (!type.ok() || !dcpl.ok()) return ReadError("dataset '" + name + "'");
  const H5T_class_t cls = H5Tget_class(type);
  if (cls != H5T_INTEGER && cls != H5T_FLOAT) return Status::Ok();
  double need = static_cast<double>(H5Tget_size(type));
  for (hsize_t d : dims) need *= static_cast<double>(d);
  if (need == 0) return Status::Ok();
  double expand = 1;
  const int filters = H5Pget_nfilters(dcpl);
  for (int i = 0; i < filters; ++i) {
    unsigned flags = 0, cd[8];
    size_t ncd = 8;
    const H5Z_filter_t f = H5Pget_filter2(dcpl, i, &flags, &ncd, cd, 0, nullptr, nullptr);
    if (f != H5Z_FILTER_FLETCHER32 && f != H5Z_FILTER_SHUFFLE) expand = 1032;
  }
  const double stored = static_cast<double>(H5Dget_storage_size(ds));
  if (stored * expand < need)
    return Status::DataLoss("dataset '" + name + "' stores " +
                            std::to_string(static_cast<long long>(stored)) + " bytes but its shape " +
                            DimsString(dims) + " needs " + std::to_string(static_cast<long long>(need)) +
                            "; the file is damaged or incomplete, re-write the trace");
  return Status::Ok();
}

// Opens dataset `name` (absolute path) and checks its shape. `dims_desc` explains the expected dims.
Status OpenDataset(hid_t file, const std::string& name, const std::vector<hsize_t>& dims,
                   const std::string& dims_desc, Hid* ds) {
  KVSIM_ASSIGN_OR_RETURN(const bool exists, LinkExists(file, name));
  if (!exists)
    return Status::InvalidArgument("missing dataset '" + name + "' (shape " + dims_desc +
                                   "); the trace is incomplete, regenerate it (" + kSeeDocs + ")");
  *ds = Hid(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);
  Hid space(ds->ok() ? H5Dget_space(*ds) : -1, H5Sclose);
  if (!space.ok()) return ReadError("dataset '" + name + "'");
  const int rank = H5Sget_simple_extent_ndims(space);
  std::vector<hsize_t> got(rank > 0 ? rank : 0);
  if (rank < 0 || H5Sget_simple_extent_dims(space, got.data(), nullptr) < 0)
    return ReadError("dataset '" + name + "'");
  if (got != dims)
    return Status::InvalidArgument("dataset '" + name + "' has shape " + DimsString(got) + ", expected " +
                                   dims_desc + "; the file does not match its root attributes");
  return CheckStored(*ds, name, got);
}

// Reads a whole 1-D integer dataset of length n into `data` through `mem_type`.
Status ReadIntegers(hid_t file, const std::string& name, hsize_t n, hid_t mem_type, void* data) {
  Hid ds;
  KVSIM_RETURN_IF_ERROR(OpenDataset(file, name, {n}, "[T=" + std::to_string(n) + "]", &ds));
  Hid type(H5Dget_type(ds), H5Tclose);
  if (!type.ok() || H5Tget_class(type) != H5T_INTEGER)
    return Status::InvalidArgument("dataset '" + name + "' must have an integer dtype (" + kSeeDocs + ")");
  if (H5Dread(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    return ReadError("dataset '" + name + "'");
  return Status::Ok();
}

// ---- streaming (docs/streaming.md): /streaming and /streaming_blocks

// A numeric attribute `name` of object `obj` (`where` names the object in messages) as int64 values, any
// number of points (scalar or 1-D). Integers only unless `allow_float` (then read through double).
Status ReadObjAttrNumbers(hid_t obj, const std::string& where, const char* name, bool allow_float,
                          std::vector<double>* out) {
  const std::string what = "attribute '" + std::string(name) + "' of '" + where + "'";
  const htri_t exists = H5Aexists(obj, name);
  if (exists < 0) return ReadError(what);
  if (exists == 0) return Status::InvalidArgument("missing " + what + " (" + kSeeDocs + ")");
  Hid attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  Hid space(attr.ok() ? H5Aget_space(attr) : -1, H5Sclose);
  Hid type(attr.ok() ? H5Aget_type(attr) : -1, H5Tclose);
  if (!space.ok() || !type.ok()) return ReadError(what);
  const H5T_class_t cls = H5Tget_class(type);
  if (cls != H5T_INTEGER && !(allow_float && cls == H5T_FLOAT))
    return Status::InvalidArgument(what + " must be " + (allow_float ? "a number" : "an integer") + " (" +
                                   kSeeDocs + ")");
  const hssize_t n = H5Sget_simple_extent_npoints(space);
  if (n < 0) return ReadError(what);
  if (cls == H5T_INTEGER) {
    std::vector<long long> v(n);
    if (n > 0 && H5Aread(attr, H5T_NATIVE_LLONG, v.data()) < 0) return ReadError(what);
    out->assign(v.begin(), v.end());
  } else {
    out->resize(n);
    if (n > 0 && H5Aread(attr, H5T_NATIVE_DOUBLE, out->data()) < 0) return ReadError(what);
  }
  return Status::Ok();
}

Status ReadObjScalar(hid_t obj, const std::string& where, const char* name, double* out) {
  std::vector<double> v;
  KVSIM_RETURN_IF_ERROR(ReadObjAttrNumbers(obj, where, name, true, &v));
  if (v.size() != 1)
    return Status::InvalidArgument("attribute '" + std::string(name) + "' of '" + where +
                                   "' must be a scalar");
  *out = v[0];
  return Status::Ok();
}
Status ReadObjScalar(hid_t obj, const std::string& where, const char* name, int* out) {
  std::vector<double> v;
  KVSIM_RETURN_IF_ERROR(ReadObjAttrNumbers(obj, where, name, false, &v));
  if (v.size() != 1 || v[0] < INT_MIN || v[0] > INT_MAX)
    return Status::InvalidArgument("attribute '" + std::string(name) + "' of '" + where +
                                   "' must be a scalar int in range");
  *out = static_cast<int>(v[0]);
  return Status::Ok();
}

// Length of the 1-D dataset `name` (absolute path).
Status Dataset1DLength(hid_t file, const std::string& name, const std::string& desc, hsize_t* n) {
  KVSIM_ASSIGN_OR_RETURN(const bool exists, LinkExists(file, name));
  if (!exists) return Status::InvalidArgument("missing dataset '" + name + "' (" + desc + "); " + kSeeDocs);
  Hid ds(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);
  Hid space(ds.ok() ? H5Dget_space(ds) : -1, H5Sclose);
  if (!space.ok()) return ReadError("dataset '" + name + "'");
  if (H5Sget_simple_extent_ndims(space) != 1)
    return Status::InvalidArgument("dataset '" + name + "' must be 1-D (" + desc + ")");
  H5Sget_simple_extent_dims(space, n, nullptr);
  return CheckStored(ds, name, {*n});
}

// Reads the whole 1-D float dataset `name` of length n as float64.
Status ReadDoubles(hid_t file, const std::string& name, hsize_t n, std::vector<double>* out) {
  Hid ds;
  KVSIM_RETURN_IF_ERROR(OpenDataset(file, name, {n}, "[" + std::to_string(n) + "]", &ds));
  Hid type(H5Dget_type(ds), H5Tclose);
  if (!type.ok() || H5Tget_class(type) != H5T_FLOAT)
    return Status::InvalidArgument("dataset '" + name + "' must have a float dtype (" + kSeeDocs + ")");
  out->resize(n);
  if (n > 0 && H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, out->data()) < 0)
    return ReadError("dataset '" + name + "'");
  return Status::Ok();
}

std::string BlockGroupName(int granularity) { return "/streaming_blocks/g" + std::to_string(granularity); }

// Reads /streaming (and, when present, /streaming_blocks) into m->stream. Only called when /streaming
// exists; the rest of the invariants are checked by Validate().
Status ReadStream(hid_t file, TraceMeta* m) {
  StreamInfo s;
  Hid g(H5Gopen2(file, "/streaming", H5P_DEFAULT), H5Gclose);
  if (!g.ok()) return ReadError("group '/streaming'");
  KVSIM_RETURN_IF_ERROR(ReadObjScalar(g, "/streaming", "fps", &s.fps));
  KVSIM_RETURN_IF_ERROR(ReadObjScalar(g, "/streaming", "init_len", &s.init_len));
  KVSIM_RETURN_IF_ERROR(ReadObjScalar(g, "/streaming", "tokens_per_frame", &s.tokens_per_frame));
  KVSIM_RETURN_IF_ERROR(ReadObjScalar(g, "/streaming", "num_frames", &s.num_frames));
  if (s.num_frames < 1 || s.num_frames > m->prefill_length)
    return Status::InvalidArgument("attribute 'num_frames' of '/streaming' is " +
                                   std::to_string(s.num_frames) + ", expected 1..prefill_length");
  KVSIM_RETURN_IF_ERROR(ReadDoubles(file, "/streaming/frame_time_s", s.num_frames, &s.frame_time_s));
  hsize_t nq = 0;
  KVSIM_RETURN_IF_ERROR(Dataset1DLength(file, "/streaming/questions/time_s", "float64 [Q]", &nq));
  if (nq > static_cast<hsize_t>(m->total_tokens()))
    return Status::InvalidArgument("dataset '/streaming/questions/time_s' has more questions than tokens");
  std::vector<double> times;
  std::vector<int32_t> begin(nq), nqt(nq), nat(nq), offsets(nq + 1);
  KVSIM_RETURN_IF_ERROR(ReadDoubles(file, "/streaming/questions/time_s", nq, &times));
  KVSIM_RETURN_IF_ERROR(
      ReadIntegers(file, "/streaming/questions/token_begin", nq, H5T_NATIVE_INT32, begin.data()));
  KVSIM_RETURN_IF_ERROR(
      ReadIntegers(file, "/streaming/questions/num_question_tokens", nq, H5T_NATIVE_INT32, nqt.data()));
  KVSIM_RETURN_IF_ERROR(
      ReadIntegers(file, "/streaming/questions/num_answer_tokens", nq, H5T_NATIVE_INT32, nat.data()));
  KVSIM_RETURN_IF_ERROR(
      ReadIntegers(file, "/streaming/questions/evidence_offsets", nq + 1, H5T_NATIVE_INT32, offsets.data()));
  hsize_t ne = 0;
  KVSIM_RETURN_IF_ERROR(Dataset1DLength(file, "/streaming/questions/evidence_frames", "int32 [E]", &ne));
  std::vector<int32_t> ev(ne);
  KVSIM_RETURN_IF_ERROR(
      ReadIntegers(file, "/streaming/questions/evidence_frames", ne, H5T_NATIVE_INT32, ev.data()));
  if (offsets[0] != 0 || offsets[nq] != static_cast<int32_t>(ne))
    return Status::InvalidArgument(
        "dataset '/streaming/questions/evidence_offsets' must start at 0 and end at the length of "
        "'/streaming/questions/evidence_frames' (" +
        std::to_string(ne) + ")");
  for (hsize_t i = 0; i < nq; ++i) {
    if (offsets[i + 1] < offsets[i])
      return Status::InvalidArgument(
          "dataset '/streaming/questions/evidence_offsets' must be non-decreasing");
    StreamQuestion q;
    q.time_s = times[i];
    q.token_begin = begin[i];
    q.num_question_tokens = nqt[i];
    q.num_answer_tokens = nat[i];
    q.evidence_frames.assign(ev.begin() + offsets[i], ev.begin() + offsets[i + 1]);
    s.questions.push_back(std::move(q));
  }
  // frames_before is derived; FramesBefore needs non-decreasing times (Validate reports them otherwise).
  if (std::is_sorted(s.frame_time_s.begin(), s.frame_time_s.end()))
    for (StreamQuestion& q : s.questions) q.frames_before = FramesBefore(s, q.time_s);

  KVSIM_ASSIGN_OR_RETURN(const bool has_blocks, LinkExists(file, "/streaming_blocks"));
  if (has_blocks) {
    Hid bg(H5Gopen2(file, "/streaming_blocks", H5P_DEFAULT), H5Gclose);
    if (!bg.ok()) return ReadError("group '/streaming_blocks'");
    std::vector<double> gran;
    KVSIM_RETURN_IF_ERROR(ReadObjAttrNumbers(bg, "/streaming_blocks", "granularities", false, &gran));
    int init_len = 0;
    KVSIM_RETURN_IF_ERROR(ReadObjScalar(bg, "/streaming_blocks", "init_len", &init_len));
    if (init_len != s.init_len)
      return Status::InvalidArgument("attribute 'init_len' of '/streaming_blocks' is " +
                                     std::to_string(init_len) + " but '/streaming' says " +
                                     std::to_string(s.init_len));
    const int64_t video_len = static_cast<int64_t>(s.num_frames) * s.tokens_per_frame;
    for (double gd : gran) {
      BlockEncodingInfo b;
      if (gd < 1 || gd > video_len)
        return Status::InvalidArgument("attribute 'granularities' of '/streaming_blocks' holds " +
                                       std::to_string(static_cast<long long>(gd)) + ", outside [1, " +
                                       std::to_string(video_len) + "] (the video's token count)");
      b.granularity = static_cast<int>(gd);
      const std::string gname = BlockGroupName(b.granularity);
      KVSIM_ASSIGN_OR_RETURN(const bool has_group, LinkExists(file, gname));
      if (!has_group)
        return Status::InvalidArgument("missing group '" + gname +
                                       "' listed in '/streaming_blocks' granularities");
      Hid gg(H5Gopen2(file, gname.c_str(), H5P_DEFAULT), H5Gclose);
      if (!gg.ok()) return ReadError("group '" + gname + "'");
      KVSIM_RETURN_IF_ERROR(ReadObjScalar(gg, gname, "num_blocks", &b.num_blocks));
      if (b.num_blocks < 0 || static_cast<int64_t>(b.num_blocks) * b.granularity > video_len)
        return Status::InvalidArgument("attribute 'num_blocks' of '" + gname + "' is " +
                                       std::to_string(b.num_blocks) + ", expected floor(" +
                                       std::to_string(video_len) + " / G)");
      const hsize_t bgn = static_cast<hsize_t>(b.num_blocks) * b.granularity;
      b.token_positions.resize(bgn);
      KVSIM_RETURN_IF_ERROR(
          ReadIntegers(file, gname + "/token_positions", bgn, H5T_NATIVE_INT32, b.token_positions.data()));
      for (int l = 0; l < m->model.num_layers; ++l) {
        KVSIM_ASSIGN_OR_RETURN(const bool has_attention,
                               LinkExists(file, LayerName(gname.c_str(), l) + "/attention_received"));
        if (has_attention) b.attention_layers.push_back(l);
      }
      s.block_encodings.push_back(std::move(b));
    }
  }
  m->stream = std::move(s);
  return Status::Ok();
}

// The optional recorded prompt entropies (docs/trace-format.md "Aggregates"): the region list, then every
// layer's [regions, kinds, num_heads] float dataset, checked like a layer's (ValidatePromptEntropies).
Status ReadPromptEntropies(hid_t file, TraceMeta* m) {
  const char* rname = "/aggregates/prompt_entropy_regions";
  KVSIM_ASSIGN_OR_RETURN(const bool has, LinkExists(file, rname));
  if (!has) return Status::Ok();
  Hid rds(H5Dopen2(file, rname, H5P_DEFAULT), H5Dclose);
  Hid rspace(rds.ok() ? H5Dget_space(rds) : -1, H5Sclose);
  hsize_t regions = 0;
  if (!rspace.ok() || H5Sget_simple_extent_ndims(rspace) != 1 ||
      H5Sget_simple_extent_dims(rspace, &regions, nullptr) < 0 || regions == 0 || regions > 64)
    return Status::InvalidArgument(std::string("dataset '") + rname +
                                   "' must be 1-D int32 [regions] with 1 to 64 entries (" + kSeeDocs + ")");
  m->prompt_entropy_regions.resize(regions);
  KVSIM_RETURN_IF_ERROR(
      ReadIntegers(file, rname, regions, H5T_NATIVE_INT32, m->prompt_entropy_regions.data()));
  KVSIM_RETURN_IF_ERROR(m->Validate());  // the region list
  const ModelInfo& mi = m->model;
  const hsize_t h = mi.num_heads, kinds = kNumPromptEntropyKinds;
  const size_t per_layer = regions * kinds * h;
  std::vector<double> all;  // grown layer by layer: sized only from datasets that exist (damaged files)
  for (int l = 0; l < mi.num_layers; ++l) {
    const std::string name = LayerName("/aggregates", l) + "/prompt_entropies";
    Hid ds;
    KVSIM_RETURN_IF_ERROR(OpenDataset(file, name, {regions, kinds, h},
                                      "[regions=" + std::to_string(regions) + ", kinds=" +
                                          std::to_string(kinds) + ", num_heads=" + std::to_string(h) + "]",
                                      &ds));
    Hid type(H5Dget_type(ds), H5Tclose);
    if (!type.ok() || H5Tget_class(type) != H5T_FLOAT)
      return Status::InvalidArgument("dataset '" + name + "' must have a float dtype (" + kSeeDocs + ")");
    all.resize(per_layer * (l + 1));
    double* dst = all.data() + per_layer * l;
    if (H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, dst) < 0)
      return ReadError("dataset '" + name + "'");
    KVSIM_RETURN_IF_ERROR(
        ValidatePromptEntropies(*m, std::span<const double>(dst, per_layer), "layer " + std::to_string(l)));
  }
  m->prompt_entropies = std::move(all);
  return Status::Ok();
}

Status ReadMeta(hid_t file, TraceMeta* m) {
  std::string format, storage, query_mode;
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "format", &format));
  if (format != kTraceFormatName)
    return Status::InvalidArgument("root attribute 'format' is '" + ForMessage(format) + "', expected '" +
                                   kTraceFormatName + "'; this HDF5 file is not a kvsim trace");
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "format_version", &m->format_version));
  if (m->format_version != kTraceFormatVersion)
    return Status::InvalidArgument("root attribute 'format_version' is " + std::to_string(m->format_version) +
                                   ", this kvsim reads version " + std::to_string(kTraceFormatVersion) +
                                   "; use a matching kvsim or regenerate the trace");
  ModelInfo& mi = m->model;
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "model_name", &mi.name));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "model_family", &mi.family));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "num_layers", &mi.num_layers));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "num_heads", &mi.num_heads));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "num_kv_heads", &mi.num_kv_heads));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "head_dim", &mi.head_dim));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "softmax_scale", &mi.softmax_scale));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "causal", &mi.causal));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "sliding_window", &mi.sliding_window));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "logit_softcap", &mi.logit_softcap));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "rope_theta", &mi.rope_theta));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "model_dtype", &mi.model_dtype));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "storage_dtype", &storage));
  if (storage != "float16" && storage != "float32")
    return Status::InvalidArgument("root attribute 'storage_dtype' is '" + ForMessage(storage) +
                                   "', expected 'float16' or 'float32'");
  m->storage_dtype = storage == "float16" ? StorageDtype::kFloat16 : StorageDtype::kFloat32;
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "prefill_length", &m->prefill_length));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "num_decode_steps", &m->num_decode_steps));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "source", &m->source));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "generator", &m->generator));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "generator_version", &m->generator_version));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "seed", &m->seed));
  KVSIM_RETURN_IF_ERROR(ReadAttr(file, "query_mode", &query_mode));
  KVSIM_RETURN_IF_ERROR(ReadOptionalAttr(file, "config_text", &m->config_text));
  KVSIM_RETURN_IF_ERROR(ReadOptionalAttr(file, "has_prefill_column_sums", &m->has_prefill_column_sums));

  // The token table is sized from these two; the rest of the invariants are checked by Validate().
  const long long t = static_cast<long long>(m->prefill_length) + m->num_decode_steps;
  if (m->prefill_length <= 0 || m->num_decode_steps < 0 || t > INT_MAX)
    return Status::InvalidArgument("root attributes 'prefill_length' (" + std::to_string(m->prefill_length) +
                                   ") and 'num_decode_steps' (" + std::to_string(m->num_decode_steps) +
                                   ") must be > 0 and >= 0");
  for (const char* name : {"/tokens/modality", "/tokens/segment_id", "/tokens/patch_row", "/tokens/patch_col",
                           "/tokens/position_id", "/tokens/phase", "/tokens/role"}) {
    Hid ds;  // shapes and stored sizes first: prefill_length comes from a root attribute
    KVSIM_RETURN_IF_ERROR(OpenDataset(file, name, {hsize_t(t)}, "[T=" + std::to_string(t) + "]", &ds));
  }
  TokenTable& tk = m->tokens;
  tk.Resize(t);
  KVSIM_RETURN_IF_ERROR(ReadIntegers(file, "/tokens/modality", t, H5T_NATIVE_UINT8, tk.modality.data()));
  KVSIM_RETURN_IF_ERROR(ReadIntegers(file, "/tokens/segment_id", t, H5T_NATIVE_INT32, tk.segment_id.data()));
  KVSIM_RETURN_IF_ERROR(ReadIntegers(file, "/tokens/patch_row", t, H5T_NATIVE_INT32, tk.patch_row.data()));
  KVSIM_RETURN_IF_ERROR(ReadIntegers(file, "/tokens/patch_col", t, H5T_NATIVE_INT32, tk.patch_col.data()));
  KVSIM_RETURN_IF_ERROR(
      ReadIntegers(file, "/tokens/position_id", t, H5T_NATIVE_INT64, tk.position_id.data()));
  KVSIM_RETURN_IF_ERROR(ReadIntegers(file, "/tokens/phase", t, H5T_NATIVE_UINT8, tk.phase.data()));
  KVSIM_RETURN_IF_ERROR(ReadIntegers(file, "/tokens/role", t, H5T_NATIVE_UINT8, tk.role.data()));
  KVSIM_ASSIGN_OR_RETURN(const bool has_token_id, LinkExists(file, "/tokens/token_id"));
  if (has_token_id)
    KVSIM_RETURN_IF_ERROR(ReadIntegers(file, "/tokens/token_id", t, H5T_NATIVE_INT64, tk.token_id.data()));
  KVSIM_ASSIGN_OR_RETURN(const bool has_text, LinkExists(file, "/tokens/text"));
  if (has_text) {
    Hid ds;
    KVSIM_RETURN_IF_ERROR(
        OpenDataset(file, "/tokens/text", {hsize_t(t)}, "[T=" + std::to_string(t) + "]", &ds));
    KVSIM_RETURN_IF_ERROR(ReadStrings(ds, false, t, "dataset '/tokens/text'", &tk.text));
  }

  const char* qname = "/queries/positions";
  KVSIM_ASSIGN_OR_RETURN(const bool has_queries, LinkExists(file, qname));
  if (!has_queries)
    return Status::InvalidArgument(std::string("missing dataset '") + qname + "'; " + kSeeDocs);
  Hid qds(H5Dopen2(file, qname, H5P_DEFAULT), H5Dclose);
  Hid qspace(qds.ok() ? H5Dget_space(qds) : -1, H5Sclose);
  if (!qspace.ok() || H5Sget_simple_extent_ndims(qspace) != 1)
    return Status::InvalidArgument(std::string("dataset '") + qname + "' must be 1-D int32 [Tq]");
  hsize_t tq = 0;
  H5Sget_simple_extent_dims(qspace, &tq, nullptr);
  if (tq > static_cast<hsize_t>(t))
    return Status::InvalidArgument(std::string("dataset '") + qname + "' has " + std::to_string(tq) +
                                   " entries, more than T = " + std::to_string(t));
  m->query_positions.resize(tq);
  KVSIM_RETURN_IF_ERROR(ReadIntegers(file, qname, tq, H5T_NATIVE_INT32, m->query_positions.data()));
  // Block encodings without /streaming (captured non-streaming traces) are an extension the reader ignores.
  KVSIM_ASSIGN_OR_RETURN(const bool has_stream, LinkExists(file, "/streaming"));
  if (has_stream) KVSIM_RETURN_IF_ERROR(ReadStream(file, m));

  KVSIM_RETURN_IF_ERROR(m->Validate());
  KVSIM_RETURN_IF_ERROR(ReadPromptEntropies(file, m));
  const char* want_mode = tq == static_cast<hsize_t>(t) ? "all" : "window_and_decode";
  if (query_mode != want_mode)
    return Status::InvalidArgument("root attribute 'query_mode' is '" + ForMessage(query_mode) + "' but " +
                                   qname + " holds " + std::to_string(tq) + " of " + std::to_string(t) +
                                   " positions; expected '" + want_mode + "'");
  return Status::Ok();
}

}  // namespace

// ---- direct chunk reads (docs/trace-format.md, "Reading")
// A dataset [outer..., rows, inner] chunked [1..., chunk_rows, inner] whose only filter is Fletcher32 stores
// each chunk as its raw little-endian elements (full chunk_rows rows, also at the edge) followed by the
// 4-byte checksum. Such chunks are read with pread (or from OpenImage's copy) on several threads, verified
// and converted to fp32 there; HDF5 is only asked where each chunk is, once per dataset.
struct DirectChunkPlan {
  bool direct = false;  // false: read through H5Dread
  size_t outer = 0, rows = 0, inner = 0, chunk_rows = 0, elem = 0;
  std::vector<uint64_t> addr, size;  // [outer * row_chunks + k]
  size_t row_chunks() const { return (rows + chunk_rows - 1) / chunk_rows; }
};

struct DirectReadState {
  int fd = -1;                 // file readers: a descriptor of their own for pread
  std::vector<uint8_t> image;  // OpenImage readers: a copy of the image
  uint64_t file_bytes = 0;
  std::map<std::string, DirectChunkPlan> plans;  // by dataset name, looked up once
  std::vector<std::vector<uint16_t>> scratch;    // per worker: one stored chunk (16-bit: aligned fp16)
  ~DirectReadState() {
    if (fd >= 0) ::close(fd);
  }
};

namespace {

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define KVSIM_FLETCHER_AVX2 1
const bool kFletcherAvx2 = CpuHas(CpuFeature::kAvx2);
std::atomic<bool> g_fletcher_avx2_allowed{true};

// HdfFletcher32's blocks of kM = 1024 whole words from word 0, 16 words (32 bytes) per step: returns the
// words done and folds each block's S1 = sum w_k and S2 part b = sum (kM - k) w_k into *s1, *s2 exactly as
// the portable 256-word loop does (the same integers, so the same residues). Each big-endian word is
// byte-swapped (vpshufb) and biased to a signed 16-bit w - 32768 so that vpmaddwd can multiply it: per
// step, a' = pair sums of the biased words, b' = pair sums of (16 - t) * word t, and the running sum of the
// earlier steps' a' is added into p' before a' (word 16 v + t of the block weighs 16 (63 - v) + (16 - t)).
// Bounds in each 32-bit lane: |a'| <= 2^22, |p'| <= 2^28, |b'| <= 2^26. The bias comes back exactly:
// a = A' + 32768 kM, b = 16 P' + B' + 32768 kM (kM + 1) / 2.
__attribute__((target("avx2"))) uint64_t Fletcher32BlocksAvx2(const uint8_t* p, uint64_t words, uint64_t n,
                                                              uint64_t* s1, uint64_t* s2, uint32_t* any) {
  constexpr uint64_t kMod = 65535, kM = 1024;
  const __m256i swap = _mm256_setr_epi8(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14, 1, 0, 3, 2, 5,
                                        4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  const __m256i bias = _mm256_set1_epi16(static_cast<short>(0x8000));
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i weights = _mm256_setr_epi16(16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1);
  auto sum = [](__m256i v) {
    alignas(32) int32_t lane[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane), v);
    int64_t t = 0;
    for (int32_t x : lane) t += x;
    return t;
  };
  uint64_t i = 0;
  for (; i + kM <= words; i += kM) {
    const uint8_t* q = p + 2 * i;
    __m256i a = _mm256_setzero_si256(), pre = a, b = a;
    for (uint64_t v = 0; v < kM / 16; ++v) {
      const __m256i w = _mm256_xor_si256(
          _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * v)), swap), bias);
      pre = _mm256_add_epi32(pre, a);
      a = _mm256_add_epi32(a, _mm256_madd_epi16(w, ones));
      b = _mm256_add_epi32(b, _mm256_madd_epi16(w, weights));
    }
    const uint64_t ta = static_cast<uint64_t>(sum(a) + int64_t{32768} * kM);
    const uint64_t tb = static_cast<uint64_t>(16 * sum(pre) + sum(b) + int64_t{32768} * (kM * (kM + 1) / 2));
    *any |= static_cast<uint32_t>(ta != 0);
    *s1 = (*s1 + ta) % kMod;
    *s2 = (*s2 + tb % kMod + ((n - i - kM) % kMod) * (ta % kMod)) % kMod;
  }
  return i;
}
#endif

}  // namespace

void SetFletcherAvx2ForTesting(bool allowed) {
#ifdef KVSIM_FLETCHER_AVX2
  g_fletcher_avx2_allowed.store(allowed, std::memory_order_relaxed);
#else
  (void)allowed;
#endif
}

namespace {

// HdfFletcher32's sums S1, S2 mod 65535 and whether any word is nonzero, built up over consecutive word
// ranges. The residues are exact whatever the ranges, so summing a message in pieces gives the same value.
struct Fletcher32Sums {
  uint64_t s1 = 0, s2 = 0;
  uint32_t any = 0;
};

// Adds words [i0, i1) of the n = size / 2 + size % 2 words of the message at p (p is the message's start;
// the odd tail byte, if any, is word n - 1, shifted up) to *f.
void Fletcher32Add(const uint8_t* p, size_t size, uint64_t i0, uint64_t i1, Fletcher32Sums* f) {
  const uint64_t n = size / 2 + size % 2;  // words, the odd tail byte included
  const uint64_t whole = std::min<uint64_t>(i1, size / 2);
  constexpr uint64_t kMod = 65535;
  constexpr size_t kBlock = 256;  // sum (kBlock - k) * 0xffff < 2^32
  uint64_t s1 = f->s1, s2 = f->s2;
  uint32_t any = f->any;
  uint64_t i = i0;
#ifdef KVSIM_FLETCHER_AVX2
  if (i < whole && kFletcherAvx2 && g_fletcher_avx2_allowed.load(std::memory_order_relaxed))
    i += Fletcher32BlocksAvx2(p + 2 * i, whole - i, n - i, &s1, &s2, &any);  // then the rest as below
#endif
  for (; i + kBlock <= whole; i += kBlock) {
    const uint8_t* q = p + 2 * i;
    uint32_t a = 0, b = 0;
    for (uint32_t k = 0; k < kBlock; ++k) {
      const uint32_t w = static_cast<uint32_t>(q[2 * k]) << 8 | q[2 * k + 1];
      a += w;
      b += (static_cast<uint32_t>(kBlock) - k) * w;
    }
    any |= a;
    // The block's words j = i + k weigh n - j = (n - i - kBlock) + (kBlock - k).
    s1 = (s1 + a) % kMod;
    s2 = (s2 + b % kMod + ((n - i - kBlock) % kMod) * (a % kMod)) % kMod;
  }
  for (; i < i1; ++i) {  // the last < kBlock words
    const uint32_t w = 2 * i + 1 < size ? (static_cast<uint32_t>(p[2 * i]) << 8 | p[2 * i + 1])
                                        : static_cast<uint32_t>(p[2 * i]) << 8;
    any |= w;
    s1 = (s1 + w) % kMod;
    s2 = (s2 + ((n - i) % kMod) * w) % kMod;
  }
  f->s1 = s1;
  f->s2 = s2;
  f->any = any;
}

uint32_t Fletcher32Value(const Fletcher32Sums& f) {
  if (!f.any) return 0;
  const uint32_t sum1 = f.s1 ? static_cast<uint32_t>(f.s1) : 0xffff,
                 sum2 = f.s2 ? static_cast<uint32_t>(f.s2) : 0xffff;
  return sum2 << 16 | sum1;
}

}  // namespace

uint32_t HdfFletcher32(const void* data_in, size_t size) {
  // HDF5's H5_checksum_fletcher32 (H5checksum.c) adds the big-endian 16-bit words w_0..w_{N-1} (an odd last
  // byte is one more word, shifted up) into sum1 and each running sum1 into sum2, folding with end-around
  // carry (x -> (x & 0xffff) + (x >> 16)) every 360 words and at the end. A fold keeps the value mod 65535
  // and keeps it positive, and the final value is <= 0xffff, so the result is: sum1 = S1 mod 65535 and
  // sum2 = S2 mod 65535 with S1 = sum w_j, S2 = sum (N - j) w_j, a residue 0 written 0xffff unless the sum
  // is 0 (every word zero). Computed that way in blocks (vectorizable 32-bit lanes), bit-identical.
  Fletcher32Sums f;
  Fletcher32Add(static_cast<const uint8_t*>(data_in), size, 0, size / 2 + size % 2, &f);
  return Fletcher32Value(f);
}

bool HdfFletcher32ChunkOk(const uint8_t* chunk, size_t size, size_t piece_words,
                          const std::function<void(size_t, size_t)>& piece_done) {
  // H5Z_filter_fletcher32 on read: the stored value is little-endian (UINT32DECODE); HDF5 < 1.6.3 wrote it
  // with each byte pair swapped on little-endian machines, and HDF5 still accepts that form.
  if (size < 4) return false;
  const size_t n = size - 4, words = n / 2 + n % 2;
  const uint32_t stored = static_cast<uint32_t>(chunk[n]) | static_cast<uint32_t>(chunk[n + 1]) << 8 |
                          static_cast<uint32_t>(chunk[n + 2]) << 16 |
                          static_cast<uint32_t>(chunk[n + 3]) << 24;
  if (piece_words == 0) piece_words = words;
  Fletcher32Sums sums;
  for (size_t i = 0; i < words; i += piece_words) {
    const size_t e = std::min(words, i + piece_words);
    Fletcher32Add(chunk, n, i, e, &sums);
    if (piece_done) piece_done(i, e);
  }
  const uint32_t f = Fletcher32Value(sums);
  const uint32_t reversed = (f & 0x00ff00ffu) << 8 | (f & 0xff00ff00u) >> 8;
  return stored == f || stored == reversed;
}

bool HdfFletcher32ChunkOk(const uint8_t* chunk, size_t size) {
  return HdfFletcher32ChunkOk(chunk, size, 0, {});
}

// HalfToFloat(in, out, n) with non-temporal stores: the layer buffers are written once here and read back
// only after the layer being replayed is done (each ~100 MB, far beyond the caches), so the stores skip the
// read-for-ownership of every output line. The same conversion (F16C, or the scalar one for the unaligned
// head and the tail), so the same bits. The caller fences (_mm_sfence) before others read `out`.
// Returns whether any of the n halves is an inf or a NaN (exponent bits all set: HalfToFloat keeps both
// classes, so exactly where `out` has them), tested on the halves as they are converted.
bool HalfToFloatStream(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  uint32_t bad = 0;
#ifdef __F16C__
  for (; i < n && reinterpret_cast<uintptr_t>(out + i) % 32 != 0; ++i) {
    bad |= static_cast<uint32_t>((in[i] & 0x7c00u) == 0x7c00u);
    out[i] = HalfToFloat(in[i]);
  }
  const __m128i exp = _mm_set1_epi16(0x7c00);
  __m128i any = _mm_setzero_si128();
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    any = _mm_or_si128(any, _mm_cmpeq_epi16(_mm_and_si128(h, exp), exp));
    _mm256_stream_ps(out + i, _mm256_cvtph_ps(h));
  }
  bad |= static_cast<uint32_t>(!_mm_testz_si128(any, any));
#endif
  for (; i < n; ++i) {
    bad |= static_cast<uint32_t>((in[i] & 0x7c00u) == 0x7c00u);
    out[i] = HalfToFloat(in[i]);
  }
  return bad != 0;
}

struct DirectChunkReader {
  DirectReadState* state;  // null: H5Dread only
  int threads;
};

namespace {

// Looks up the direct-read plan of an open dataset (`plan->direct` false: not a layout read directly).
Status MakeChunkPlan(hid_t ds, hid_t type, const std::string& name, const std::vector<hsize_t>& dims,
                     bool half, uint64_t file_bytes, DirectChunkPlan* plan) {
  plan->direct = false;
  const int rank = static_cast<int>(dims.size());
  if (rank < 2) return Status::Ok();
  if (!half && H5Tequal(type, H5T_IEEE_F32LE) <= 0) return Status::Ok();
  Hid dcpl(H5Dget_create_plist(ds), H5Pclose);
  if (!dcpl.ok() || H5Pget_layout(dcpl) != H5D_CHUNKED || H5Pget_nfilters(dcpl) != 1) return Status::Ok();
  unsigned flags = 0, cd[8];
  size_t ncd = 8;
  if (H5Pget_filter2(dcpl, 0, &flags, &ncd, cd, 0, nullptr, nullptr) != H5Z_FILTER_FLETCHER32)
    return Status::Ok();
  std::vector<hsize_t> cdims(rank);
  if (H5Pget_chunk(dcpl, rank, cdims.data()) != rank) return Status::Ok();
  for (int i = 0; i + 2 < rank; ++i)
    if (cdims[i] != 1) return Status::Ok();
  if (cdims[rank - 1] != dims[rank - 1] || cdims[rank - 2] == 0) return Status::Ok();
  plan->outer = 1;
  for (int i = 0; i + 2 < rank; ++i) plan->outer *= dims[i];
  plan->rows = dims[rank - 2];
  plan->inner = dims[rank - 1];
  plan->chunk_rows = cdims[rank - 2];
  plan->elem = half ? 2 : 4;
  const size_t nchunks = plan->outer * plan->row_chunks();
  if (nchunks == 0) return Status::Ok();
  const uint64_t want = static_cast<uint64_t>(plan->chunk_rows) * plan->inner * plan->elem + 4;
  plan->addr.assign(nchunks, 0);
  plan->size.assign(nchunks, 0);
  std::vector<hsize_t> coord(rank, 0);
  for (size_t o = 0; o < plan->outer; ++o) {
    size_t rest = o;  // leading coordinates of outer index o (row-major)
    for (int i = rank - 3; i >= 0; --i) {
      coord[i] = rest % dims[i];
      rest /= dims[i];
    }
    for (size_t k = 0; k < plan->row_chunks(); ++k) {
      coord[rank - 2] = k * plan->chunk_rows;
      unsigned mask = 0;
      haddr_t addr = HADDR_UNDEF;
      hsize_t size = 0;
      // Not stored (fill values), a filter skipped or an unexpected size: HDF5 decides (H5Dread).
      if (H5Dget_chunk_info_by_coord(ds, coord.data(), &mask, &addr, &size) < 0) {
        H5Eclear2(H5E_DEFAULT);
        return Status::Ok();
      }
      if (addr == HADDR_UNDEF || mask != 0 || size != want) return Status::Ok();
      if (addr > file_bytes || size > file_bytes - addr)
        return Status::DataLoss("dataset '" + name + "': chunk at row " + std::to_string(coord[rank - 2]) +
                                " of leading index " + std::to_string(o) + " lies at bytes [" +
                                std::to_string(addr) + ", " + std::to_string(addr + size) +
                                ") but the file holds " + std::to_string(file_bytes) +
                                " bytes; the file is truncated, copy it again or re-write it");
      plan->addr[o * plan->row_chunks() + k] = addr;
      plan->size[o * plan->row_chunks() + k] = size;
    }
  }
  plan->direct = true;
  return Status::Ok();
}

// Reads float dataset `name` into fp32 `out` ([dims], fully sized), checking its shape and dtype. Only
// rows in `rows` of the second-to-last dimension are read when `rows` is not all (queries); the others are
// left as they were. With `direct`, plain checksummed chunks are read by DirectChunkReader; otherwise (and
// for every other layout) one H5Dread of the selected rows.
// `finite` (optional): set when the direct path read the dataset; then *finite is the flat index of its first
// non-finite value among the rows read (SIZE_MAX: none), found in the conversion threads while the rows are
// in cache, so ValidateLayer need not scan them again. Left unset on the H5Dread path.
Status ReadFloats(hid_t file, const std::string& name, const std::vector<hsize_t>& dims,
                  const std::string& desc, StorageDtype dtype, std::vector<uint16_t>* scratch,
                  std::vector<float>* out, const QueryRows& rows = QueryRows(),
                  const DirectChunkReader* direct = nullptr, std::optional<size_t>* finite = nullptr) {
  Hid ds;
  KVSIM_RETURN_IF_ERROR(OpenDataset(file, name, dims, desc, &ds));
  Hid type(H5Dget_type(ds), H5Tclose);
  const bool half = dtype == StorageDtype::kFloat16;
  const bool is_float = type.ok() && H5Tget_class(type) == H5T_FLOAT;
  if (!is_float || (half ? !IsHalf(type) : H5Tget_size(type) != 4))
    return Status::InvalidArgument(
        "dataset '" + name + "' holds " +
        (is_float ? std::to_string(8 * H5Tget_size(type)) + "-bit floats" : std::string("non-floats")) +
        ", expected " + StorageDtypeName(dtype) +
        " (IEEE, little-endian) as root attribute 'storage_dtype' says");
  size_t n = 1;
  for (hsize_t d : dims) n *= d;
  out->resize(n);
  const int rank = static_cast<int>(dims.size());
  const size_t nrows = rank >= 2 ? dims[rank - 2] : 1, inner = rank >= 2 ? dims[rank - 1] : n;
  const size_t outer = nrows * inner > 0 ? n / (nrows * inner) : 0;
  const bool subset = !rows.all() && rank >= 2;
  const std::vector<std::pair<int32_t, int32_t>> ranges =
      subset ? rows.Ranges(static_cast<int32_t>(nrows))
             : std::vector<std::pair<int32_t, int32_t>>{{0, static_cast<int32_t>(nrows)}};
  if (n == 0 || (subset && ranges.empty())) return Status::Ok();

  if (direct && direct->state) {
    DirectReadState& r = *direct->state;
    auto found = r.plans.find(name);
    if (found == r.plans.end()) {
      DirectChunkPlan plan;
      KVSIM_RETURN_IF_ERROR(MakeChunkPlan(ds, type, name, dims, half, r.file_bytes, &plan));
      found = r.plans.emplace(name, std::move(plan)).first;
    }
    const DirectChunkPlan& plan = found->second;
    if (plan.direct) {
      // Work items: the chunks holding at least one wanted row, in file order of (outer, row chunk).
      std::vector<size_t> items;
      const size_t rc = plan.row_chunks();
      for (size_t o = 0; o < plan.outer; ++o)
        for (size_t k = 0; k < rc; ++k) {
          const size_t r0 = k * plan.chunk_rows, r1 = std::min(nrows, r0 + plan.chunk_rows);
          for (const auto& [b, e] : ranges)
            if (static_cast<size_t>(b) < r1 && static_cast<size_t>(e) > r0) {
              items.push_back(o * rc + k);
              break;
            }
        }
      const int workers = std::max(1, std::min<int>(direct->threads > 0 ? direct->threads : DefaultThreads(),
                                                    static_cast<int>(items.size())));
      if (static_cast<int>(r.scratch.size()) < workers) r.scratch.resize(workers);
      std::vector<Status> status(items.size());
      std::vector<size_t> first_bad(finite ? items.size() : 0, SIZE_MAX);
      float* dst = out->data();
      ParallelForWorkers(static_cast<int>(items.size()), workers, [&](int item, int worker) {
        const size_t c = items[item], o = c / rc, k = c % rc;
        const uint64_t addr = plan.addr[c], size = plan.size[c];
        std::vector<uint16_t>& store = r.scratch[worker];  // 16-bit storage: the fp16 view is aligned
        store.resize((size + 1) / 2);
        uint16_t* const words = store.data();
        uint8_t* const bytes = reinterpret_cast<uint8_t*>(words);
        size_t got = 0;
        if (r.fd >= 0) {
          while (got < size) {
            const ssize_t k2 = ::pread(r.fd, bytes + got, size - got, static_cast<off_t>(addr + got));
            if (k2 < 0 && errno == EINTR) continue;
            if (k2 <= 0) break;
            got += static_cast<size_t>(k2);
          }
        } else if (addr <= r.image.size() && size <= r.image.size() - addr) {
          std::memcpy(bytes, r.image.data() + addr, size);
          got = size;
        }
        const size_t r0 = k * plan.chunk_rows, r1 = std::min(nrows, r0 + plan.chunk_rows);
        const std::string chunk = "the chunk at row " + std::to_string(r0) + " of leading index " +
                                  std::to_string(o) + ", file bytes [" + std::to_string(addr) + ", " +
                                  std::to_string(addr + size) + ")";
        if (got < size) {
          status[item] =
              Status::DataLoss("cannot read dataset '" + name + "' (" + chunk + "): the file ends at byte " +
                               std::to_string(addr + got) + "; the file may be truncated or corrupt");
          return;
        }
        // One pass per piece of kPieceWords words while it is in L1: its checksum sums, then the wanted
        // rows' conversion and finite scan (a damaged chunk is refused after its rows were written; the
        // read fails, so they are never used).
        constexpr size_t kPieceWords = 4096;
        auto convert = [&](size_t w0, size_t w1) {
          for (const auto& [b, e] : ranges) {
            const size_t lo = std::max<size_t>({static_cast<size_t>(b), r0, r0 + w0 / inner}),
                         hi = std::min<size_t>({static_cast<size_t>(e), r1, r0 + (w1 + inner - 1) / inner});
            if (lo >= hi) continue;
            const size_t first = (lo - r0) * inner, count = (hi - lo) * inner;
            float* d = dst + (o * nrows + lo) * inner;
            bool bad = false;
            if (half) {
              bad = HalfToFloatStream(words + first, d, count);
            } else {
              std::memcpy(d, bytes + first * 4, count * 4);
              if (finite) {  // branch-free scan of the rows just written
                uint32_t any = 0;
                for (size_t i = 0; i < count; ++i) {
                  uint32_t u;
                  std::memcpy(&u, d + i, 4);
                  any |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
                }
                bad = any != 0;
              }
            }
            if (finite && bad)  // locate the first bad value only if there is one
              for (size_t i = 0; i < count; ++i)
                if (!std::isfinite(d[i])) {
                  first_bad[item] = std::min(first_bad[item], static_cast<size_t>(d + i - dst));
                  break;
                }
          }
        };
        // Pieces of whole rows of the stored elements (fp32: 2 words each).
        const size_t elem_words = half ? 1 : 2;
        const size_t piece = std::max<size_t>(1, kPieceWords / (inner * elem_words)) * inner * elem_words;
        if (!HdfFletcher32ChunkOk(bytes, size, piece, [&](size_t w0, size_t w1) {
              convert(w0 / elem_words, (w1 + elem_words - 1) / elem_words);
            })) {
          status[item] = Status::DataLoss("dataset '" + name + "' fails its checksum (Fletcher32 of " +
                                          chunk + "): the file is damaged; copy it again or re-write it");
          return;
        }
#ifdef __F16C__
        if (half) _mm_sfence();  // HalfToFloatStream's stores are visible before the item counts as done
#endif
      });
      for (const Status& st : status)
        if (!st.ok()) return st;
      if (finite)
        *finite = first_bad.empty() ? SIZE_MAX : *std::min_element(first_bad.begin(), first_bad.end());
      return Status::Ok();
    }
  }

  // Through the library: every row in one read, or a hyperslab of the wanted rows (same selection in memory).
  Hid fspace, mspace;
  hid_t fsel = H5S_ALL, msel = H5S_ALL;
  if (subset) {
    fspace = Hid(H5Dget_space(ds), H5Sclose);
    mspace = Hid(H5Screate_simple(rank, dims.data(), nullptr), H5Sclose);
    if (!fspace.ok() || !mspace.ok()) return ReadError("dataset '" + name + "'");
    std::vector<hsize_t> start(rank, 0), count(dims);
    bool first = true;
    for (const auto& [b, e] : ranges) {
      start[rank - 2] = b;
      count[rank - 2] = e - b;
      const H5S_seloper_t op = first ? H5S_SELECT_SET : H5S_SELECT_OR;
      if (H5Sselect_hyperslab(fspace, op, start.data(), nullptr, count.data(), nullptr) < 0 ||
          H5Sselect_hyperslab(mspace, op, start.data(), nullptr, count.data(), nullptr) < 0)
        return ReadError("dataset '" + name + "'");
      first = false;
    }
    fsel = fspace;
    msel = mspace;
  }
  if (half) {
    scratch->resize(n);  // raw 16-bit read: the file type as memory type means no HDF5 conversion
    if (H5Dread(ds, type, msel, fsel, H5P_DEFAULT, scratch->data()) < 0)
      return ReadError("dataset '" + name + "'");
    for (size_t o = 0; o < outer; ++o)
      for (const auto& [b, e] : ranges)
        HalfToFloat(scratch->data() + (o * nrows + b) * inner, out->data() + (o * nrows + b) * inner,
                    static_cast<size_t>(e - b) * inner);
  } else if (H5Dread(ds, H5T_NATIVE_FLOAT, msel, fsel, H5P_DEFAULT, out->data()) < 0) {
    return ReadError("dataset '" + name + "'");
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------- writing

Status WriteAttr(hid_t file, const char* name, hid_t file_type, hid_t mem_type, const void* value) {
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid attr(space.ok() ? H5Acreate2(file, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT) : -1, H5Aclose);
  if (!attr.ok() || H5Awrite(attr, mem_type, value) < 0)
    return WriteError(std::string("root attribute '") + name + "'");
  return Status::Ok();
}
Status WriteAttr(hid_t file, const char* name, long long v) {
  return WriteAttr(file, name, H5T_STD_I64LE, H5T_NATIVE_LLONG, &v);
}
Status WriteAttr(hid_t file, const char* name, double v) {
  return WriteAttr(file, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v);
}
Status WriteAttr(hid_t file, const char* name, const std::string& v) {
  Hid type = FixedUtf8StringType(v.size());
  const std::string padded = v.empty() ? std::string(1, '\0') : v;
  return type.ok() ? WriteAttr(file, name, type, type, padded.data())
                   : WriteError(std::string("root attribute '") + name + "'");
}

// Creation property lists without object modification times, so the same trace written twice is the same
// bytes (and so has the same hash in results). Created once, never closed.
hid_t UntimedGroupCreation() {
  static const hid_t gcpl = [] {
    const hid_t p = H5Pcreate(H5P_GROUP_CREATE);
    if (p >= 0) H5Pset_obj_track_times(p, 0);
    return p;
  }();
  return gcpl;
}
hid_t UntimedDatasetCreation() {
  static const hid_t dcpl = [] {
    const hid_t p = H5Pcreate(H5P_DATASET_CREATE);
    if (p >= 0) H5Pset_obj_track_times(p, 0);
    return p;
  }();
  return dcpl;
}

// Creates and writes dataset `name` (relative to `loc`) in one H5Dwrite. Without a `dcpl`, a non-empty
// dataset is chunked (one chunk per leading index for rank >= 2) with a Fletcher32 checksum, untimed.
Status WriteDataset(hid_t loc, const std::string& name, hid_t file_type, hid_t mem_type,
                    const std::vector<hsize_t>& dims, const void* data, hid_t dcpl = H5P_DEFAULT) {
  Hid space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
  Hid own;
  if (dcpl == H5P_DEFAULT) {
    const bool empty = std::find(dims.begin(), dims.end(), hsize_t{0}) != dims.end();
    if (empty) {
      dcpl = UntimedDatasetCreation();  // nothing to checksum; HDF5 cannot chunk a zero-sized dataset
    } else {
      std::vector<hsize_t> chunk = dims;
      for (size_t i = 0; i + 1 < chunk.size(); ++i) chunk[i] = 1;
      own = Hid(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
      if (!own.ok() || H5Pset_chunk(own, static_cast<int>(chunk.size()), chunk.data()) < 0 ||
          H5Pset_fill_time(own, H5D_FILL_TIME_NEVER) < 0 || H5Pset_obj_track_times(own, 0) < 0 ||
          H5Pset_fletcher32(own) < 0)
        return WriteError("dataset '" + name + "'");
      dcpl = own;
    }
  }
  Hid ds(space.ok() ? H5Dcreate2(loc, name.c_str(), file_type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT) : -1,
         H5Dclose);
  if (!ds.ok() || H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    return WriteError("dataset '" + name + "'");
  return Status::Ok();
}

Status WriteNamesAttr(hid_t file, const char* dataset, const char* names) {
  Hid ds(H5Dopen2(file, dataset, H5P_DEFAULT), H5Dclose);
  Hid type = FixedUtf8StringType(std::strlen(names));
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid attr(ds.ok() && type.ok() && space.ok() ? H5Acreate2(ds, "names", type, space, H5P_DEFAULT, H5P_DEFAULT)
                                              : -1,
           H5Aclose);
  if (!attr.ok() || H5Awrite(attr, type, names) < 0)
    return WriteError(std::string("attribute 'names' of '") + dataset + "'");
  return Status::Ok();
}

// Writes /streaming and the /streaming_blocks skeleton (attrs and token positions; the per-layer tensors are
// written by WriteLayer).
Status WriteStream(hid_t file, const StreamInfo& s) {
  Hid g(H5Gcreate2(file, "/streaming", H5P_DEFAULT, UntimedGroupCreation(), H5P_DEFAULT), H5Gclose);
  Hid qg(g.ok() ? H5Gcreate2(file, "/streaming/questions", H5P_DEFAULT, UntimedGroupCreation(), H5P_DEFAULT)
                : -1,
         H5Gclose);
  if (!qg.ok()) return WriteError("group '/streaming'");
  KVSIM_RETURN_IF_ERROR(WriteAttr(g, "fps", s.fps));
  KVSIM_RETURN_IF_ERROR(WriteAttr(g, "init_len", static_cast<long long>(s.init_len)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(g, "tokens_per_frame", static_cast<long long>(s.tokens_per_frame)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(g, "num_frames", static_cast<long long>(s.num_frames)));
  KVSIM_RETURN_IF_ERROR(WriteDataset(g, "frame_time_s", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE,
                                     {s.frame_time_s.size()}, s.frame_time_s.data()));
  const size_t nq = s.questions.size();
  std::vector<double> times(nq);
  std::vector<int32_t> begin(nq), nqt(nq), nat(nq), offsets(nq + 1, 0), ev;
  for (size_t i = 0; i < nq; ++i) {
    const StreamQuestion& q = s.questions[i];
    times[i] = q.time_s;
    begin[i] = q.token_begin;
    nqt[i] = q.num_question_tokens;
    nat[i] = q.num_answer_tokens;
    ev.insert(ev.end(), q.evidence_frames.begin(), q.evidence_frames.end());
    offsets[i + 1] = static_cast<int32_t>(ev.size());
  }
  KVSIM_RETURN_IF_ERROR(WriteDataset(qg, "time_s", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, {nq}, times.data()));
  KVSIM_RETURN_IF_ERROR(WriteDataset(qg, "token_begin", H5T_STD_I32LE, H5T_NATIVE_INT32, {nq}, begin.data()));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(qg, "num_question_tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, {nq}, nqt.data()));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(qg, "num_answer_tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, {nq}, nat.data()));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(qg, "evidence_offsets", H5T_STD_I32LE, H5T_NATIVE_INT32, {nq + 1}, offsets.data()));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(qg, "evidence_frames", H5T_STD_I32LE, H5T_NATIVE_INT32, {ev.size()}, ev.data()));
  if (s.block_encodings.empty()) return Status::Ok();
  Hid bg(H5Gcreate2(file, "/streaming_blocks", H5P_DEFAULT, UntimedGroupCreation(), H5P_DEFAULT), H5Gclose);
  if (!bg.ok()) return WriteError("group '/streaming_blocks'");
  KVSIM_RETURN_IF_ERROR(WriteAttr(bg, "init_len", static_cast<long long>(s.init_len)));
  std::vector<long long> gran;
  for (const BlockEncodingInfo& b : s.block_encodings) gran.push_back(b.granularity);
  {
    const hsize_t n = gran.size();
    Hid space(H5Screate_simple(1, &n, nullptr), H5Sclose);
    Hid attr(
        space.ok() ? H5Acreate2(bg, "granularities", H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT) : -1,
        H5Aclose);
    if (!attr.ok() || H5Awrite(attr, H5T_NATIVE_LLONG, gran.data()) < 0)
      return WriteError("attribute 'granularities' of '/streaming_blocks'");
  }
  for (const BlockEncodingInfo& b : s.block_encodings) {
    const std::string name = BlockGroupName(b.granularity);
    Hid gg(H5Gcreate2(file, name.c_str(), H5P_DEFAULT, UntimedGroupCreation(), H5P_DEFAULT), H5Gclose);
    if (!gg.ok()) return WriteError("group '" + name + "'");
    KVSIM_RETURN_IF_ERROR(WriteAttr(gg, "granularity", static_cast<long long>(b.granularity)));
    KVSIM_RETURN_IF_ERROR(WriteAttr(gg, "num_blocks", static_cast<long long>(b.num_blocks)));
    KVSIM_RETURN_IF_ERROR(WriteDataset(gg, "token_positions", H5T_STD_I32LE, H5T_NATIVE_INT32,
                                       {b.token_positions.size()}, b.token_positions.data()));
  }
  return Status::Ok();
}

Status WriteMeta(hid_t file, const TraceMeta& m) {
  const ModelInfo& mi = m.model;
  const TokenTable& tk = m.tokens;
  const hsize_t t = m.total_tokens();
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "format", std::string(kTraceFormatName)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "format_version", static_cast<long long>(m.format_version)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "model_name", mi.name));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "model_family", mi.family));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "num_layers", static_cast<long long>(mi.num_layers)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "num_heads", static_cast<long long>(mi.num_heads)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "num_kv_heads", static_cast<long long>(mi.num_kv_heads)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "head_dim", static_cast<long long>(mi.head_dim)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "softmax_scale", mi.softmax_scale));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "causal", static_cast<long long>(mi.causal)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "sliding_window", static_cast<long long>(mi.sliding_window)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "logit_softcap", mi.logit_softcap));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "rope_theta", mi.rope_theta));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "model_dtype", mi.model_dtype));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "storage_dtype", std::string(StorageDtypeName(m.storage_dtype))));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "prefill_length", static_cast<long long>(m.prefill_length)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "num_decode_steps", static_cast<long long>(m.num_decode_steps)));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "source", m.source));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "generator", m.generator));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "generator_version", m.generator_version));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "seed", H5T_STD_U64LE, H5T_NATIVE_UINT64, &m.seed));
  KVSIM_RETURN_IF_ERROR(WriteAttr(file, "query_mode",
                                  std::string(m.query_positions.size() == t ? "all" : "window_and_decode")));
  if (!m.config_text.empty()) KVSIM_RETURN_IF_ERROR(WriteAttr(file, "config_text", m.config_text));
  KVSIM_RETURN_IF_ERROR(
      WriteAttr(file, "has_prefill_column_sums", static_cast<long long>(m.has_prefill_column_sums)));

  for (const char* group : {"/tokens", "/queries", "/layers"}) {
    Hid g(H5Gcreate2(file, group, H5P_DEFAULT, UntimedGroupCreation(), H5P_DEFAULT), H5Gclose);
    if (!g.ok()) return WriteError(std::string("group '") + group + "'");
  }
  if (m.has_prefill_column_sums || !m.prompt_entropy_regions.empty()) {
    Hid g(H5Gcreate2(file, "/aggregates", H5P_DEFAULT, UntimedGroupCreation(), H5P_DEFAULT), H5Gclose);
    if (!g.ok()) return WriteError("group '/aggregates'");
  }
  if (!m.prompt_entropy_regions.empty())
    KVSIM_RETURN_IF_ERROR(WriteDataset(file, "/aggregates/prompt_entropy_regions", H5T_STD_I32LE,
                                       H5T_NATIVE_INT32, {m.prompt_entropy_regions.size()},
                                       m.prompt_entropy_regions.data()));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(file, "/tokens/modality", H5T_STD_U8LE, H5T_NATIVE_UINT8, {t}, tk.modality.data()));
  KVSIM_RETURN_IF_ERROR(WriteNamesAttr(file, "/tokens/modality", kModalityNames));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(file, "/tokens/segment_id", H5T_STD_I32LE, H5T_NATIVE_INT32, {t}, tk.segment_id.data()));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(file, "/tokens/patch_row", H5T_STD_I32LE, H5T_NATIVE_INT32, {t}, tk.patch_row.data()));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(file, "/tokens/patch_col", H5T_STD_I32LE, H5T_NATIVE_INT32, {t}, tk.patch_col.data()));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(file, "/tokens/position_id", H5T_STD_I64LE, H5T_NATIVE_INT64, {t}, tk.position_id.data()));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(file, "/tokens/phase", H5T_STD_U8LE, H5T_NATIVE_UINT8, {t}, tk.phase.data()));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(file, "/tokens/role", H5T_STD_U8LE, H5T_NATIVE_UINT8, {t}, tk.role.data()));
  KVSIM_RETURN_IF_ERROR(WriteNamesAttr(file, "/tokens/role", kRoleNames));
  KVSIM_RETURN_IF_ERROR(
      WriteDataset(file, "/tokens/token_id", H5T_STD_I64LE, H5T_NATIVE_INT64, {t}, tk.token_id.data()));
  if (!tk.text.empty()) {
    size_t width = 1;
    for (const std::string& x : tk.text) width = std::max(width, x.size());
    Hid type = FixedUtf8StringType(width);
    std::vector<char> buf(t * width, '\0');
    for (hsize_t i = 0; i < t; ++i) std::memcpy(&buf[i * width], tk.text[i].data(), tk.text[i].size());
    if (!type.ok()) return WriteError("dataset '/tokens/text'");
    KVSIM_RETURN_IF_ERROR(WriteDataset(file, "/tokens/text", type, type, {t}, buf.data()));
  }
  KVSIM_RETURN_IF_ERROR(WriteDataset(file, "/queries/positions", H5T_STD_I32LE, H5T_NATIVE_INT32,
                                     {m.query_positions.size()}, m.query_positions.data()));
  return m.stream ? WriteStream(file, *m.stream) : Status::Ok();
}

// ---- integrity (docs/trace-format.md, "Integrity")

bool IsVariableString(hid_t type) { return H5Tget_class(type) == H5T_STRING && H5Tis_variable_str(type) > 0; }

herr_t CountAttr(hid_t obj, const char* name, const H5A_info_t*, void* data) {
  Hid attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  Hid type(attr.ok() ? H5Aget_type(attr) : -1, H5Tclose);
  if (!type.ok()) return -1;
  if (IsVariableString(type)) ++static_cast<TraceIntegrity*>(data)->variable_length_strings;
  return 0;
}

herr_t VisitObject(hid_t loc, const char* name, const H5O_info_t* info, void* data) {
  auto* in = static_cast<TraceIntegrity*>(data);
  Hid obj(H5Oopen(loc, name, H5P_DEFAULT), H5Oclose);
  if (!obj.ok()) return -1;
  hsize_t idx = 0;
  if (H5Aiterate2(obj, H5_INDEX_NAME, H5_ITER_NATIVE, &idx, CountAttr, in) < 0) return -1;
  if (info->type != H5O_TYPE_DATASET) return 0;
  Hid type(H5Dget_type(obj), H5Tclose), space(H5Dget_space(obj), H5Sclose),
      dcpl(H5Dget_create_plist(obj), H5Pclose);
  if (!type.ok() || !space.ok() || !dcpl.ok()) return -1;
  if (H5Sget_simple_extent_npoints(space) == 0) return 0;
  ++in->datasets;
  if (IsVariableString(type)) ++in->variable_length_strings;
  unsigned flags = 0, cd[8];
  size_t ncd = 8;
  if (H5Pget_filter_by_id2(dcpl, H5Z_FILTER_FLETCHER32, &flags, &ncd, cd, 0, nullptr, nullptr) >= 0)
    ++in->checksummed_datasets;
  H5Eclear2(H5E_DEFAULT);  // "filter not found" is an answer, not an error
  return 0;
}

Status ScanIntegrity(hid_t file, TraceIntegrity* out) {
  TraceIntegrity in;
  in.known = true;
  H5F_info2_t info;
  if (H5Fget_info2(file, &info) < 0) return ReadError("the file's superblock");
  in.superblock_version = static_cast<int>(info.super.version);
  if (H5Ovisit2(file, H5_INDEX_NAME, H5_ITER_NATIVE, VisitObject, &in, H5O_INFO_BASIC) < 0)
    return ReadError("the file's objects (integrity scan)");
  *out = in;
  return Status::Ok();
}

// ---- the guarded open: a damaged file can still crash or hang the HDF5 library (variable-length strings
// of files written without checksums live in an unchecksummed global heap), so Open() first reads all of
// a file's metadata in a child process and only then in this one.

// KVSIM_TRACE_GUARD=0 turns the guard off; KVSIM_TRACE_GUARD_TIMEOUT bounds the child (seconds, default 60).
StatusOr<double> GuardTimeout() {
  const char* on = std::getenv("KVSIM_TRACE_GUARD");
  if (on && std::string(on) == "0") return 0.0;
  if (on && *on && std::string(on) != "1")
    return Status::InvalidArgument(std::string("environment variable KVSIM_TRACE_GUARD='") + on +
                                   "' must be 0 (off) or 1 (on)");
  const char* t = std::getenv("KVSIM_TRACE_GUARD_TIMEOUT");
  if (!t || !*t) return 60.0;
  char* end = nullptr;
  const double v = std::strtod(t, &end);
  if (end == t || *end || !(v > 0) || !std::isfinite(v))
    return Status::InvalidArgument(std::string("environment variable KVSIM_TRACE_GUARD_TIMEOUT='") + t +
                                   "' must be a positive number of seconds");
  return v;
}

// In the child: address space capped at what it has now plus the memory kvsim may use, so a damaged file
// that makes the library allocate without bound fails there, not in the machine (not under ASan, whose
// shadow memory needs terabytes of address space).
void LimitChildMemory() {
  if (kAddressSanitizer) return;
  auto avail = AvailableMemoryBytes();
  if (!avail.ok()) return;
  unsigned long long pages = 0;
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%llu", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  // At least 1 GiB of headroom: metadata needs little, and a tight KVSIM_MAX_MEMORY must yield the
  // reader's own one-line message, not a crash of the child.
  const rlim_t cap =
      static_cast<rlim_t>(pages) * ::sysconf(_SC_PAGESIZE) + std::max<uint64_t>(*avail, 1ull << 30);
  struct rlimit rl {
    cap, cap
  };
  ::setrlimit(RLIMIT_AS, &rl);
}

void WriteAll(int fd, const std::string& s) {
  for (size_t off = 0; off < s.size();) {
    const ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

// Files a guarded child has read without fault, and this process after it (Open): a file with the same
// identity (device, inode, size, modification and status-change times) is not probed again by this
// process (a sweep opens its trace three times: the kind check, the plan's check, the replay). Only files
// whose two times were at least kStableSeconds old before the probe are remembered: any later change to
// the file (its bytes, or its times through utimensat) sets its status-change time to the time of that
// change, which then differs, so a changed file is always probed again.
struct FileIdentity {
  dev_t dev = 0;
  ino_t ino = 0;
  off_t size = 0;
  timespec mtime{}, ctime{};
  bool operator==(const FileIdentity& o) const {
    return dev == o.dev && ino == o.ino && size == o.size && mtime.tv_sec == o.mtime.tv_sec &&
           mtime.tv_nsec == o.mtime.tv_nsec && ctime.tv_sec == o.ctime.tv_sec &&
           ctime.tv_nsec == o.ctime.tv_nsec;
  }
};
constexpr double kStableSeconds = 2.0;
constexpr size_t kProbedFiles = 64;  // the most recent ones
std::mutex probed_mu;
std::vector<FileIdentity> probed;    // oldest first
std::atomic<bool> probe_memo{true};  // SetGuardMemoForTesting
std::atomic<double> stable_seconds{kStableSeconds};
std::atomic<int> probes_run{0};  // GuardedProbesForTesting

// The identity of a regular file whose times are stable (kStableSeconds before now); nullopt otherwise.
std::optional<FileIdentity> StableIdentity(const std::string& path) {
  struct stat sb;
  if (!probe_memo.load() || ::stat(path.c_str(), &sb) != 0 || !S_ISREG(sb.st_mode)) return std::nullopt;
  timespec now;
  ::clock_gettime(CLOCK_REALTIME, &now);
  auto age = [&](const timespec& t) {
    return static_cast<double>(now.tv_sec - t.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec - t.tv_nsec);
  };
  const double min_age = stable_seconds.load();
  if (age(sb.st_mtim) < min_age || age(sb.st_ctim) < min_age) return std::nullopt;
  return FileIdentity{sb.st_dev, sb.st_ino, sb.st_size, sb.st_mtim, sb.st_ctim};
}

bool ProbedBefore(const FileIdentity& id) {
  std::lock_guard<std::mutex> lock(probed_mu);
  return std::find(probed.begin(), probed.end(), id) != probed.end();
}

void RememberProbed(const FileIdentity& id) {
  std::lock_guard<std::mutex> lock(probed_mu);
  if (std::find(probed.begin(), probed.end(), id) != probed.end()) return;
  if (probed.size() == kProbedFiles) probed.erase(probed.begin());
  probed.push_back(id);
}

}  // namespace

void SetGuardMemoForTesting(bool enabled, double stable_s) {
  probe_memo.store(enabled);
  stable_seconds.store(stable_s);
  std::lock_guard<std::mutex> lock(probed_mu);
  probed.clear();
}

int GuardedProbesForTesting() { return probes_run.load(); }

Status Hdf5TraceReader::GuardedProbe(const std::string& path, bool* probed) {
  KVSIM_ASSIGN_OR_RETURN(const double timeout_s, GuardTimeout());
  if (timeout_s == 0) return Status::Ok();
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return Status::Ok();  // cannot guard: read unguarded
  std::fflush(nullptr);
  probes_run.fetch_add(1);
  pthread_rwlock_wrlock(Hdf5ForkLock());  // no other thread inside HDF5
  const pid_t pid = ::fork();
  if (pid == 0)
    hdf5_use_depth = 1;  // the child is alone: its copy of the lock stays as it is, unused
  else
    pthread_rwlock_unlock(Hdf5ForkLock());
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return Status::Ok();
  }
  if (pid == 0) {  // child: read everything Open() reads, report the status, never return
    ::close(fds[0]);
    // The pipe is the child's only output: nothing it (or a sanitizer reporting the library's crash) prints
    // reaches the user's terminal or the command's one-line error.
    if (const int null = ::open("/dev/null", O_WRONLY); null >= 0) {
      ::dup2(null, STDOUT_FILENO);
      ::dup2(null, STDERR_FILENO);
    }
    LimitChildMemory();
    Status st;
    try {
      auto r = OpenUnguarded(path);
      st = r.ok() ? Status::Ok() : r.status();
    } catch (const std::bad_alloc&) {
      st = Status::DataLoss(path + ": reading the file's metadata exhausted memory (a damaged file?)");
    }
    WriteAll(fds[1], std::to_string(static_cast<int>(st.code())) + "\n" + st.message());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string reply;
  bool timed_out = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    struct pollfd pfd {
      fds[0], POLLIN, 0
    };
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(left.count(), 1000)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF: the child exited (or crashed)
    reply.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  if (timed_out) ::kill(pid, SIGKILL);
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  const std::string fix = "; the file is damaged: re-capture or re-synthesize it (docs/hardening.md)";
  if (timed_out)
    return Status::DataLoss(path + ": reading the file's HDF5 metadata did not finish within " +
                            std::to_string(static_cast<int>(timeout_s)) +
                            " s (KVSIM_TRACE_GUARD_TIMEOUT) in a guarded process" + fix);
  if (WIFSIGNALED(wstatus))
    return Status::DataLoss(path + ": the HDF5 library crashed (" + strsignal(WTERMSIG(wstatus)) +
                            ") reading the file's metadata in a guarded process" + fix);
  const size_t nl = reply.find('\n');
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0 || nl == std::string::npos)
    return Status::DataLoss(path + ": the guarded process reading the file's metadata failed" + fix);
  const int code = std::atoi(reply.substr(0, nl).c_str());
  if (code < 0 || code > static_cast<int>(StatusCode::kInternal))
    return Status::Internal(path + ": the guarded process sent an unknown status");
  if (probed) *probed = true;  // the child read the file's metadata to the end (its status, ok or not)
  return Status::FromCode(static_cast<StatusCode>(code), reply.substr(nl + 1));
}

// ---------------------------------------------------------------------------------------------- reader

StatusOr<std::unique_ptr<Hdf5TraceReader>> Hdf5TraceReader::Open(const std::string& path) {
  // A file this process has probed and opened before, unchanged since, is not probed again (FileIdentity).
  // Remembered only when a child probed it: not with the guard off.
  const std::optional<FileIdentity> id = StableIdentity(path);
  const bool known = id && ProbedBefore(*id);
  bool probed = false;
  if (!known) KVSIM_RETURN_IF_ERROR(GuardedProbe(path, &probed));
  auto r = OpenUnguarded(path);
  if (r.ok() && id && probed) RememberProbed(*id);
  return r;
}

StatusOr<std::unique_ptr<Hdf5TraceReader>> Hdf5TraceReader::OpenUnguarded(const std::string& path) {
  const Hdf5Use hdf5_use;
  SilenceHdf5Errors();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::NotFound(path + ": no such file");
  if (std::filesystem::is_directory(path, ec))
    return Status::InvalidArgument(path + ": is a folder; expected a kvsim trace file (" + kSeeDocs + ")");
  const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
  if (is_hdf5 == 0)
    return Status::InvalidArgument(path + ": not an HDF5 file; expected a kvsim trace (" + kSeeDocs + ")");
  Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  hid_t file = -1;
  if (is_hdf5 > 0 && fapl.ok() && H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG) >= 0)
    file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl);
  if (file < 0)
    return Status::DataLoss(path + ": cannot open as HDF5" + Hdf5Detail() +
                            "; check permissions, or the file is truncated or corrupt");
  KVSIM_ASSIGN_OR_RETURN(std::unique_ptr<Hdf5TraceReader> r,
                         FromOpenFile(path, file, /*checksummed_only=*/false));
  // A second descriptor for direct chunk reads (ReadLayer); without one, every read goes through HDF5.
  auto direct = std::make_unique<DirectReadState>();
  direct->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat sb;
  if (direct->fd >= 0 && ::fstat(direct->fd, &sb) == 0 && S_ISREG(sb.st_mode)) {
    direct->file_bytes = static_cast<uint64_t>(sb.st_size);
    r->direct_ = std::move(direct);
  }
  return r;
}

StatusOr<std::unique_ptr<Hdf5TraceReader>> Hdf5TraceReader::OpenImage(const std::string& name,
                                                                      const void* data, size_t size) {
  const Hdf5Use hdf5_use;
  SilenceHdf5Errors();
  Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  hid_t file = -1;
  if (size > 0 && fapl.ok() && H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG) >= 0 &&
      H5Pset_fapl_core(fapl, 1 << 20, /*backing_store=*/0) >= 0 &&
      H5Pset_file_image(fapl, const_cast<void*>(data), size) >= 0)
    file = H5Fopen(name.c_str(), H5F_ACC_RDONLY, fapl);
  if (file < 0)
    return Status::DataLoss(name + ": cannot open as HDF5" + Hdf5Detail() +
                            "; the image is truncated or corrupt");
  // The core driver reads zeros past the end of an image (and a zeroed chunk passes Fletcher32), so a
  // truncated image is caught here, as the default driver catches a truncated file.
  hsize_t file_size = 0;
  if (H5Fget_filesize(file, &file_size) < 0 || file_size > size) {
    H5Fclose(file);
    return Status::DataLoss(name + ": truncated: the file's end is at byte " + std::to_string(file_size) +
                            " but the image holds " + std::to_string(size));
  }
  KVSIM_ASSIGN_OR_RETURN(std::unique_ptr<Hdf5TraceReader> r,
                         FromOpenFile(name, file, /*checksummed_only=*/true));
  // Direct chunk reads copy from a second copy of the image (the core driver keeps its own).
  r->direct_ = std::make_unique<DirectReadState>();
  r->direct_->image.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + size);
  r->direct_->file_bytes = size;
  return r;
}

StatusOr<std::unique_ptr<Hdf5TraceReader>> Hdf5TraceReader::FromOpenFile(const std::string& name,
                                                                         long long file,
                                                                         bool checksummed_only) {
  std::unique_ptr<Hdf5TraceReader> r(new Hdf5TraceReader());
  r->path_ = name;
  r->file_ = file;
  Status st;
  if (checksummed_only) {
    // Without the guard, only a file whose every structure is checksummed is read: the superblock version
    // is known before anything else is parsed, and the scan reads types, never string values.
    H5F_info2_t info;
    if (H5Fget_info2(file, &info) < 0) {
      st = ReadError("the file's superblock");
    } else if (info.super.version < 2) {
      st = Status::InvalidArgument("HDF5 superblock v" + std::to_string(info.super.version) +
                                   " has no checksums; an in-memory image must be a checksummed trace (open "
                                   "older traces from a file, through the guarded Open)");
    } else {
      st = ScanIntegrity(file, &r->integrity_);
      if (st.ok() && !r->integrity_.checksummed())
        st = Status::InvalidArgument("not a fully checksummed trace (" + r->integrity_.Text() +
                                     "); an in-memory image must be one");
    }
  }
  if (st.ok()) st = ReadMeta(file, &r->meta_);
  if (st.ok()) st = r->CheckLayerShapes();
  if (st.ok() && !checksummed_only) st = ScanIntegrity(file, &r->integrity_);
  if (!st.ok()) return st.WithContext(name);
  return r;
}

// Every layer's datasets have the shapes the root attributes imply, and no layer is stored beyond
// num_layers: checked from the file's metadata before anything is allocated from those attributes.
Status Hdf5TraceReader::CheckLayerShapes() const {
  const ModelInfo& mi = meta_.model;
  const hsize_t kvh = mi.num_kv_heads, h = mi.num_heads, d = mi.head_dim, t = meta_.total_tokens(),
                tq = meta_.query_positions.size(), n = meta_.prefill_length;
  const std::string dd = ", head_dim=" + std::to_string(d) + "]";
  const std::string kv_desc = "[num_kv_heads=" + std::to_string(kvh) + ", T=" + std::to_string(t) + dd;
  const std::string q_desc = "[num_heads=" + std::to_string(h) + ", Tq=" + std::to_string(tq) + dd;
  for (int l = 0; l < mi.num_layers; ++l) {
    const std::string group = LayerName("/layers", l);
    Hid ds;
    KVSIM_RETURN_IF_ERROR(OpenDataset(file_, group + "/keys", {kvh, t, d}, kv_desc, &ds));
    KVSIM_RETURN_IF_ERROR(OpenDataset(file_, group + "/values", {kvh, t, d}, kv_desc, &ds));
    KVSIM_RETURN_IF_ERROR(OpenDataset(file_, group + "/queries", {h, tq, d}, q_desc, &ds));
    if (meta_.has_prefill_column_sums)
      KVSIM_RETURN_IF_ERROR(OpenDataset(
          file_, LayerName("/aggregates", l) + "/prefill_column_sums", {h, n},
          "[num_heads=" + std::to_string(h) + ", prefill_length=" + std::to_string(n) + "]", &ds));
  }
  const std::string extra = LayerName("/layers", mi.num_layers);
  KVSIM_ASSIGN_OR_RETURN(const bool has_extra, LinkExists(file_, extra));
  if (has_extra)
    return Status::InvalidArgument("stores '" + extra + "' but root attribute 'num_layers' is " +
                                   std::to_string(mi.num_layers) +
                                   ": the attribute is smaller than the stored layers (a damaged file?)");
  // The engine holds two layers (one replayed, the next prefetched) as float32.
  return CheckMemory(2 * LayerFloatBytes(meta_), "two layers of keys, values and queries as float32 (" +
                                                     std::to_string(kvh) + " KV heads x " +
                                                     std::to_string(t) + " tokens x head_dim " +
                                                     std::to_string(d) + ")");
}

Hdf5TraceReader::~Hdf5TraceReader() {
  const Hdf5Use hdf5_use;
  if (file_ >= 0) H5Fclose(file_);
}

Status Hdf5TraceReader::ReadLayer(int layer, LayerData* out, const LayerReadOptions& options) {
  const Hdf5Use hdf5_use;
  SilenceHdf5Errors();
  const ModelInfo& mi = meta_.model;
  if (layer < 0 || layer >= mi.num_layers)
    return Status::NotFound(path_ + ": layer " + std::to_string(layer) + " not in [0, " +
                            std::to_string(mi.num_layers) + ")");
  const hsize_t kvh = mi.num_kv_heads, h = mi.num_heads, d = mi.head_dim, t = meta_.total_tokens(),
                tq = meta_.query_positions.size(), n = meta_.prefill_length;
  const std::string dd = ", head_dim=" + std::to_string(d) + "]";
  const std::string kv_desc = "[num_kv_heads=" + std::to_string(kvh) + ", T=" + std::to_string(t) + dd;
  const std::string q_desc = "[num_heads=" + std::to_string(h) + ", Tq=" + std::to_string(tq) + dd;
  const std::string group = LayerName("/layers", layer);
  out->layer = layer;
  out->query_rows = QueryRows::None();  // until the queries are read
  const DirectChunkReader direct{options.direct_chunks ? direct_.get() : nullptr, options.threads};
  const QueryRows all;
  // Finiteness of each dataset as the direct reads found it (unset: read through H5Dread, scanned below).
  std::optional<size_t> finite[4];
  Status st = ReadFloats(file_, group + "/keys", {kvh, t, d}, kv_desc, meta_.storage_dtype, &scratch_,
                         &out->keys, all, &direct, &finite[0]);
  if (st.ok())
    st = ReadFloats(file_, group + "/values", {kvh, t, d}, kv_desc, meta_.storage_dtype, &scratch_,
                    &out->values, all, &direct, &finite[1]);
  if (st.ok())
    st = ReadFloats(file_, group + "/queries", {h, tq, d}, q_desc, meta_.storage_dtype, &scratch_,
                    &out->queries, options.query_rows, &direct, &finite[2]);
  if (st.ok()) out->query_rows = options.query_rows;
  out->prefill_column_sums.clear();
  if (st.ok() && meta_.has_prefill_column_sums)
    st = ReadFloats(file_, LayerName("/aggregates", layer) + "/prefill_column_sums", {h, n},
                    "[num_heads=" + std::to_string(h) + ", prefill_length=" + std::to_string(n) + "]",
                    StorageDtype::kFloat32, &scratch_, &out->prefill_column_sums, all, &direct, &finite[3]);
  else
    finite[3] = SIZE_MAX;  // none stored: nothing to scan
  out->prompt_entropies.clear();
  if (const double* e = meta_.RecordedPromptEntropies(
          layer, meta_.prompt_entropy_regions.empty() ? -1 : meta_.prompt_entropy_regions[0]))
    out->prompt_entropies.assign(
        e, e + meta_.prompt_entropy_regions.size() * kNumPromptEntropyKinds * static_cast<size_t>(h));
  if (!st.ok()) return st.WithContext(path_);
  bool scanned = true;
  const char* names[4] = {"keys", "values", "queries", "prefill_column_sums"};
  for (int i = 0; i < 4; ++i) {
    if (!finite[i]) {
      scanned = false;
    } else if (*finite[i] != SIZE_MAX) {
      return NonFiniteError(path_ + ": layer " + std::to_string(layer), names[i], *finite[i]);
    }
  }
  return ValidateLayer(meta_, *out, path_, /*check_finite=*/!scanned);
}

Status Hdf5TraceReader::ReadBlockLayer(int granularity, int layer, BlockLayerData* out) {
  const Hdf5Use hdf5_use;
  SilenceHdf5Errors();
  const BlockEncodingInfo* info = meta_.is_streaming() ? meta_.stream->FindBlocks(granularity) : nullptr;
  if (!info) return TraceSource::ReadBlockLayer(granularity, layer, out);
  const ModelInfo& mi = meta_.model;
  if (layer < 0 || layer >= mi.num_layers)
    return Status::NotFound(path_ + ": layer " + std::to_string(layer) + " not in [0, " +
                            std::to_string(mi.num_layers) + ")");
  const hsize_t kvh = mi.num_kv_heads, h = mi.num_heads, d = mi.head_dim,
                bg = static_cast<hsize_t>(info->num_blocks) * info->granularity;
  const std::string kv_desc = "[num_kv_heads=" + std::to_string(kvh) + ", B*G=" + std::to_string(bg) +
                              ", head_dim=" + std::to_string(d) + "]";
  const std::string group = LayerName(BlockGroupName(granularity).c_str(), layer);
  out->granularity = granularity;
  Status st =
      ReadFloats(file_, group + "/keys", {kvh, bg, d}, kv_desc, meta_.storage_dtype, &scratch_, &out->keys);
  if (st.ok())
    st = ReadFloats(file_, group + "/values", {kvh, bg, d}, kv_desc, meta_.storage_dtype, &scratch_,
                    &out->values);
  out->attention_received.clear();
  if (st.ok() && std::binary_search(info->attention_layers.begin(), info->attention_layers.end(), layer))
    st = ReadFloats(file_, group + "/attention_received", {h, bg},
                    "[num_heads=" + std::to_string(h) + ", B*G=" + std::to_string(bg) + "]",
                    StorageDtype::kFloat32, &scratch_, &out->attention_received);
  if (!st.ok()) return st.WithContext(path_);
  return ValidateBlockLayer(meta_, layer, *out, path_);
}

StatusOr<bool> Hdf5TraceReader::ReadRecordedDecodeRows(int layer, std::vector<float>* out) {
  const Hdf5Use hdf5_use;
  SilenceHdf5Errors();
  const std::string name = LayerName("/capture/decode_attention", layer);
  auto has_rows = LinkExists(file_, name);
  if (!has_rows.ok()) return has_rows.status().WithContext(path_);
  if (!*has_rows) return false;
  const hsize_t h = meta_.model.num_heads, s = meta_.num_decode_steps, t = meta_.total_tokens();
  Status st = ReadFloats(file_, name, {h, s, t},
                         "[num_heads=" + std::to_string(h) + ", decode_steps=" + std::to_string(s) +
                             ", T=" + std::to_string(t) + "]",
                         StorageDtype::kFloat32, &scratch_, out);
  if (!st.ok()) return st.WithContext(path_);
  for (float x : *out)
    if (!std::isfinite(x))
      return Status::DataLoss(path_ + ": " + name + " holds a non-finite value (re-capture the trace)");
  return true;
}

// ---------------------------------------------------------------------------------------------- writer

StatusOr<std::unique_ptr<Hdf5TraceWriter>> Hdf5TraceWriter::Create(const std::string& path,
                                                                   Hdf5WriteOptions options) {
  const Hdf5Use hdf5_use;
  SilenceHdf5Errors();
  if (options.compression_level < 0 || options.compression_level > 9)
    return Status::InvalidArgument(path + ": compression_level " + std::to_string(options.compression_level) +
                                   " is not in [0, 9]");
  if (options.chunk_tokens <= 0)
    return Status::InvalidArgument(path + ": chunk_tokens must be > 0, got " +
                                   std::to_string(options.chunk_tokens));
  if (options.compression_level > 0 && H5Zfilter_avail(H5Z_FILTER_DEFLATE) <= 0)
    return Status::FailedPrecondition(path + ": this HDF5 library lacks gzip; use compression_level 0");
  std::unique_ptr<Hdf5TraceWriter> w(new Hdf5TraceWriter());
  w->path_ = path;
  w->tmp_path_ = path + ".tmp." + std::to_string(::getpid());
  w->options_ = options;
  Hid fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  // The latest file format: superblock v3, object headers v2 and every other metadata structure carry
  // checksums that the library verifies on read.
  // The root group without object times, as every other object (the same trace is the same bytes).
  Hid fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
  if (fapl.ok() && fcpl.ok() && H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG) >= 0 &&
      H5Pset_libver_bounds(fapl, H5F_LIBVER_LATEST, H5F_LIBVER_LATEST) >= 0 &&
      H5Pset_obj_track_times(fcpl, 0) >= 0)
    w->file_ = H5Fcreate(w->tmp_path_.c_str(), H5F_ACC_TRUNC, fcpl, fapl);
  if (w->file_ < 0)
    return Status::InvalidArgument(path + ": cannot create temporary file '" + w->tmp_path_ + "'" +
                                   Hdf5Detail() + "; check that the folder exists and is writable");
  return w;
}

Hdf5TraceWriter::~Hdf5TraceWriter() {
  const Hdf5Use hdf5_use;
  if (file_ >= 0) H5Fclose(file_);
  if (!finished_) std::remove(tmp_path_.c_str());
}

Status Hdf5TraceWriter::Begin(const TraceMeta& meta) {
  const Hdf5Use hdf5_use;
  SilenceHdf5Errors();
  if (began_ || file_ < 0)
    return Status::FailedPrecondition(path_ + ": Begin() called twice or after Finish()");
  KVSIM_RETURN_IF_ERROR(meta.Validate().WithContext(path_));
  KVSIM_RETURN_IF_ERROR(CheckDisk(
      TraceStoredBytes(meta), path_,
      path_ + ": the trace" + (options_.compression_level > 0 ? " (size before compression)" : "")));
  began_ = true;
  meta_ = meta;
  return WriteMeta(file_, meta_).WithContext(path_);
}

Status Hdf5TraceWriter::WriteLayer(const LayerData& layer) {
  const Hdf5Use hdf5_use;
  SilenceHdf5Errors();
  const ModelInfo& mi = meta_.model;
  if (!began_ || file_ < 0)
    return Status::FailedPrecondition(path_ + ": WriteLayer() before Begin() or after Finish()");
  if (layer.layer != next_layer_ || next_layer_ >= mi.num_layers)
    return Status::InvalidArgument(path_ + ": layers must be written in order 0.." +
                                   std::to_string(mi.num_layers - 1) + "; expected layer " +
                                   std::to_string(next_layer_) + ", got " + std::to_string(layer.layer));
  KVSIM_RETURN_IF_ERROR(ValidateLayer(meta_, layer, path_));
  KVSIM_RETURN_IF_ERROR(ValidateLayerBlocks(meta_, layer, path_));
  if (layer.prefill_column_sums.empty() == meta_.has_prefill_column_sums)
    return Status::InvalidArgument(
        path_ + ": layer " + std::to_string(layer.layer) +
        (meta_.has_prefill_column_sums ? " lacks" : " has") +
        " prefill_column_sums but meta.has_prefill_column_sums is " +
        (meta_.has_prefill_column_sums ? "true" : "false") +
        "; every layer must have them, or none, as the meta passed to Begin() says");
  KVSIM_RETURN_IF_ERROR(CheckLayerPromptEntropies(meta_, layer, path_));
  const hsize_t kvh = mi.num_kv_heads, h = mi.num_heads, d = mi.head_dim, t = meta_.total_tokens(),
                tq = meta_.query_positions.size();
  const bool half = meta_.storage_dtype == StorageDtype::kFloat16;
  if (half) {  // checked before anything of this layer is written
    std::vector<std::pair<std::string, const std::vector<float>*>> tensors = {
        {"keys", &layer.keys}, {"values", &layer.values}, {"queries", &layer.queries}};
    for (const BlockLayerData& b : layer.blocks) {
      tensors.emplace_back("g" + std::to_string(b.granularity) + " block keys", &b.keys);
      tensors.emplace_back("g" + std::to_string(b.granularity) + " block values", &b.values);
    }
    for (const auto& [name, v] : tensors)
      if (const int64_t i = FirstBeyondHalf(*v); i >= 0)
        return Status::InvalidArgument(path_ + ": layer " + std::to_string(layer.layer) + " dataset '" +
                                       name + "' holds " + std::to_string((*v)[i]) + " at flat index " +
                                       std::to_string(i) +
                                       ", beyond the float16 range (+-65504); use storage_dtype float32");
  }
  Hid half_type = HalfType();
  const std::string group = LayerName("/layers", layer.layer);
  Hid g(half_type.ok() ? H5Gcreate2(file_, group.c_str(), H5P_DEFAULT, UntimedGroupCreation(), H5P_DEFAULT)
                       : -1,
        H5Gclose);
  if (!g.ok()) return WriteError("group '" + group + "'").WithContext(path_);

  auto write_tensor_in = [&](hid_t loc, const std::string& group, const char* name, hsize_t heads,
                             hsize_t rows, const std::vector<float>& data) {
    const hsize_t chunk[3] = {1, std::min<hsize_t>(rows, options_.chunk_tokens), d};
    Hid dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    bool ok = dcpl.ok() && H5Pset_chunk(dcpl, 3, chunk) >= 0 &&
              H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER) >= 0 && H5Pset_obj_track_times(dcpl, 0) >= 0;
    if (ok && options_.compression_level > 0)
      ok = H5Pset_shuffle(dcpl) >= 0 && H5Pset_deflate(dcpl, options_.compression_level) >= 0;
    if (ok) ok = H5Pset_fletcher32(dcpl) >= 0;  // last: the checksum covers the stored (compressed) bytes
    if (!ok) return WriteError("dataset '" + group + "/" + name + "'");
    const void* buf = data.data();
    if (half) {
      scratch_.resize(data.size());
      FloatToHalf(data.data(), scratch_.data(), data.size());
      buf = scratch_.data();
    }
    return WriteDataset(loc, name, half ? half_type : H5T_IEEE_F32LE, half ? half_type : H5T_NATIVE_FLOAT,
                        {heads, rows, d}, buf, dcpl);
  };
  auto write_tensor = [&](const char* name, hsize_t heads, hsize_t rows, const std::vector<float>& data) {
    return write_tensor_in(g, group, name, heads, rows, data);
  };
  Status st = write_tensor("keys", kvh, t, layer.keys);
  if (st.ok()) st = write_tensor("values", kvh, t, layer.values);
  if (st.ok()) st = write_tensor("queries", h, tq, layer.queries);
  const bool entropies = !meta_.prompt_entropy_regions.empty();
  if (st.ok() && (meta_.has_prefill_column_sums || entropies)) {
    const std::string agg = LayerName("/aggregates", layer.layer);
    Hid ag(H5Gcreate2(file_, agg.c_str(), H5P_DEFAULT, UntimedGroupCreation(), H5P_DEFAULT), H5Gclose);
    if (!ag.ok()) st = WriteError("group '" + agg + "'");
    if (st.ok() && meta_.has_prefill_column_sums)
      st = WriteDataset(ag, "prefill_column_sums", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                        {h, static_cast<hsize_t>(meta_.prefill_length)}, layer.prefill_column_sums.data());
    if (st.ok() && entropies)
      st = WriteDataset(ag, "prompt_entropies", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE,
                        {meta_.prompt_entropy_regions.size(), hsize_t{kNumPromptEntropyKinds}, h},
                        layer.prompt_entropies.data());
  }
  for (size_t i = 0; st.ok() && i < layer.blocks.size(); ++i) {
    const BlockLayerData& b = layer.blocks[i];
    const hsize_t bgn = static_cast<hsize_t>(meta_.stream->block_encodings[i].num_blocks) * b.granularity;
    const std::string bgroup = LayerName(BlockGroupName(b.granularity).c_str(), layer.layer);
    Hid lg(H5Gcreate2(file_, bgroup.c_str(), H5P_DEFAULT, UntimedGroupCreation(), H5P_DEFAULT), H5Gclose);
    if (!lg.ok()) {
      st = WriteError("group '" + bgroup + "'");
      break;
    }
    st = write_tensor_in(lg, bgroup, "keys", kvh, bgn, b.keys);
    if (st.ok()) st = write_tensor_in(lg, bgroup, "values", kvh, bgn, b.values);
    if (st.ok() && !b.attention_received.empty())
      st = WriteDataset(lg, "attention_received", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {h, bgn},
                        b.attention_received.data());
  }
  if (!st.ok()) return st.WithContext(path_);
  ++next_layer_;
  return Status::Ok();
}

Status Hdf5TraceWriter::Finish() {
  const Hdf5Use hdf5_use;
  SilenceHdf5Errors();
  if (!began_ || file_ < 0)
    return Status::FailedPrecondition(path_ + ": Finish() before Begin() or called twice");
  if (next_layer_ != meta_.model.num_layers)
    return Status::FailedPrecondition(path_ + ": Finish() after " + std::to_string(next_layer_) + " of " +
                                      std::to_string(meta_.model.num_layers) +
                                      " layers; write every layer first");
  const herr_t closed = H5Fclose(std::exchange(file_, -1));
  if (closed < 0) return WriteError("'" + tmp_path_ + "' (closing)").WithContext(path_);
  std::error_code ec;
  std::filesystem::rename(tmp_path_, path_, ec);
  if (ec)
    return Status::Internal(path_ + ": cannot rename '" + tmp_path_ + "' into place: " + ec.message() +
                            "; check permissions of the folder and that the path is not a folder");
  finished_ = true;
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------- hashing

namespace {

// HashFile's state: four independent lanes; per 8-byte word: xor, multiply by an odd constant, xorshift (each
// step is a bijection of the lane state, so a change confined to one word always changes that lane).
struct FileHasher {
  static constexpr uint64_t kMul = 0x9e3779b97f4a7c15ull;
  static uint64_t Mix(uint64_t h, uint64_t w) {
    h = (h ^ w) * kMul;
    return h ^ (h >> 29);
  }
  uint64_t lane[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull,
                      0x082efa98ec4e6c89ull};
  // Whole 32-byte blocks only (`n` a multiple of 32).
  void Blocks(const unsigned char* p, size_t n) {
    for (size_t i = 0; i < n; i += 32)
      for (int k = 0; k < 4; ++k) {
        uint64_t w;
        std::memcpy(&w, p + i + 8 * k, 8);
        lane[k] = Mix(lane[k], w);
      }
  }
  // The last partial block, zero-padded.
  void Tail(const unsigned char* p, size_t n) {
    unsigned char block[32] = {};
    std::memcpy(block, p, n);
    Blocks(block, 32);
  }
  std::string Finish(uint64_t total) const {
    uint64_t h = total * kMul;
    for (uint64_t l : lane) {
      h = Mix(h, l);
      h = Mix(h, h >> 31);  // murmur-style avalanche between lanes
    }
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
    return std::string(hex);
  }
};

}  // namespace

StatusOr<std::string> HashFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::NotFound(path + ": no such file");
    return Status::InvalidArgument(path + ": cannot open for hashing: " + std::strerror(errno));
  }
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(::fdopen(fd, "rb"), &std::fclose);
  if (!f) {
    ::close(fd);
    return Status::InvalidArgument(path + ": cannot open for hashing: " + std::strerror(errno));
  }
  FileHasher hasher;
  struct stat sb;
  if (::fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size > 0) {
    // A regular file: hashed straight from the page cache through a mapping (no copy into a buffer). A
    // file that shrinks meanwhile is an error, not a crash (ReadGuarded).
    const uint64_t size = static_cast<uint64_t>(sb.st_size);
    constexpr uint64_t kWindow = uint64_t{16} << 20;  // multiple of 32; unmapped after use (resident set)
    bool mapped = true;
    for (uint64_t at = 0; mapped && at < size; at += kWindow) {
      const size_t n = static_cast<size_t>(std::min(kWindow, size - at));
      auto m = MappedFile::Map(fd, at, n, path);
      if (!m.ok()) {
        if (at == 0) {
          mapped = false;  // read through a buffer below
          break;
        }
        return m.status();
      }
      ::madvise(const_cast<uint8_t*>(m->data()), n, MADV_SEQUENTIAL);
      const unsigned char* p = m->data();
      auto hash = [&] {
        hasher.Blocks(p, n / 32 * 32);
        if (n % 32) hasher.Tail(p + n / 32 * 32, n % 32);
      };
      if (!ReadGuarded(p, n, hash)) {
        struct stat now;
        const long long left = ::fstat(fd, &now) == 0 ? static_cast<long long>(now.st_size) : -1;
        return Status::DataLoss(path + ": the file shrank to " + std::to_string(left) +
                                " bytes while it was being hashed (it held " + std::to_string(size) +
                                "); do not change a trace while kvsim reads it");
      }
    }
    if (mapped) return hasher.Finish(size);
  }
  // Anything else (a pipe, an empty file, a file that cannot be mapped): read through a buffer.
  constexpr size_t kChunk = size_t{8} << 20;  // multiple of 32: only the file's last block is partial
  std::vector<unsigned char> buf(kChunk);
  uint64_t total = 0;
  for (size_t got = kChunk; got == kChunk;) {
    got = std::fread(buf.data(), 1, kChunk, f.get());
    total += got;
    hasher.Blocks(buf.data(), got / 32 * 32);
    if (got % 32) hasher.Tail(buf.data() + got / 32 * 32, got % 32);
  }
  if (std::ferror(f.get())) return Status::DataLoss(path + ": read error while hashing");
  return hasher.Finish(total);
}

bool FileInPageCache(const std::string& path) {
  // O_NONBLOCK: a FIFO without a writer would block the open (it is not a regular file: false below).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return false;
  struct stat sb;
  bool resident = false;
  if (::fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size > 0) {
    const uint64_t size = static_cast<uint64_t>(sb.st_size);
    auto m = MappedFile::Map(fd, 0, size, path);  // address space only: mincore reads no page
    if (m.ok()) {
      const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
      const auto base = reinterpret_cast<uintptr_t>(m->data()) / page * page;  // data() is at offset 0
      const uint64_t len = reinterpret_cast<uintptr_t>(m->data()) - base + size;
      std::vector<unsigned char> in((len + page - 1) / page);
      if (::mincore(reinterpret_cast<void*>(base), len, in.data()) == 0)
        // At most 1% missing: a few evicted pages (the demo trace, warm, had 131 of 789836 out) are read from
        // the disk by whichever comes first; what costs is the whole file streaming from it twice.
        resident = static_cast<size_t>(std::count_if(in.begin(), in.end(), [](unsigned char c) {
                     return (c & 1) == 0;
                   })) <= in.size() / 100;
    }
  }
  ::close(fd);
  return resident;
}

}  // namespace kvsim
