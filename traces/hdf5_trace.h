#pragma once
// HDF5 implementation of the trace format (docs/trace-format.md): a reader that streams one layer (or one
// head of one layer) at a time, and a writer that never leaves a partial file under the final name.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "sim/trace.h"

namespace kvsim {

struct Hdf5WriteOptions {
  int compression_level = 0;  // 0 = none; 1..9 = gzip (deflate) with byte shuffle
  int chunk_tokens = 1024;    // chunk shape [1, min(T, chunk_tokens), head_dim]: one head reads alone
};

struct DirectReadState;  // hdf5_trace.cc

class Hdf5TraceReader final : public TraceSource {
 public:
  // Opens and validates the root attributes, the token table and every dataset's shape and stored size.
  // Errors name the file and the field. Guarded: all of this is first done in a forked child process, so a
  // damaged file that crashes, hangs or exhausts the HDF5 library is a one-line error here
  // (docs/hardening.md; KVSIM_TRACE_GUARD=0 turns it off). Safe from any thread: the fork waits until no
  // other thread is inside one of this file's HDF5 calls.
  static StatusOr<std::unique_ptr<Hdf5TraceReader>> Open(const std::string& path);
  // The same without the child process (what the guarded child itself runs).
  static StatusOr<std::unique_ptr<Hdf5TraceReader>> OpenUnguarded(const std::string& path);
  // The same from an in-memory copy of a trace file (`name` is used in messages); the bytes are copied. Not
  // guarded, so only a fully checksummed trace is accepted (TraceIntegrity::checksummed(): checked from the
  // superblock and the objects' types before any string is read); older traces go through Open(). The
  // reader keeps a second copy of the bytes for direct chunk reads (the HDF5 core driver holds its own).
  static StatusOr<std::unique_ptr<Hdf5TraceReader>> OpenImage(const std::string& name, const void* data,
                                                              size_t size);
  ~Hdf5TraceReader() override;
  const TraceMeta& meta() const override { return meta_; }
  using TraceSource::ReadLayer;
  // Datasets chunked one leading index at a time whose only filter is Fletcher32 (what kvsim writes without
  // compression) are read chunk by chunk with pread on options.threads threads, outside the HDF5 library,
  // each chunk's checksum verified as HDF5 does; any other layout goes through H5Dread (docs/trace-format.md,
  // "Reading").
  Status ReadLayer(int layer, LayerData* out, const LayerReadOptions& options) override;
  std::string Describe() const override { return path_; }
  TraceIntegrity integrity() const override { return integrity_; }
  StatusOr<bool> ReadRecordedDecodeRows(int layer, std::vector<float>* out) override;
  // Streaming traces: /streaming_blocks/gG/layer_XXX (fp16 converted to fp32), validated.
  Status ReadBlockLayer(int granularity, int layer, BlockLayerData* out) override;

 private:
  Hdf5TraceReader() = default;
  Status CheckLayerShapes() const;
  static StatusOr<std::unique_ptr<Hdf5TraceReader>> FromOpenFile(const std::string& name, long long file,
                                                                 bool checksummed_only);
  // `probed`: set when a child process read the metadata to the end (not with the guard off).
  static Status GuardedProbe(const std::string& path, bool* probed = nullptr);
  std::string path_;
  long long file_ = -1;  // hid_t
  TraceMeta meta_;
  TraceIntegrity integrity_;
  std::vector<uint16_t> scratch_;  // raw fp16 of the dataset being read
  // Direct chunk reads (ReadLayer): the file's descriptor or image copy, chunk locations, buffers.
  std::unique_ptr<DirectReadState> direct_;
};

// HDF5's Fletcher32 checksum (H5_checksum_fletcher32) of `size` bytes: what the Fletcher32 filter stores in
// the last 4 bytes of every chunk (exposed for tests).
// On x86 CPUs with AVX2 its whole 1024-word blocks are summed 16 words at a time (the same value by
// construction); SetFletcherAvx2ForTesting(false) forces the portable loop (tests compare the two).
uint32_t HdfFletcher32(const void* data, size_t size);
void SetFletcherAvx2ForTesting(bool allowed);
// Test hooks of the guarded open's memo (Hdf5TraceReader::Open): `enabled` false probes every open;
// `stable_s` is how old a file's times must be to be remembered (2 s); both clear the memo.
// GuardedProbesForTesting counts the child processes this process has started.
void SetGuardMemoForTesting(bool enabled, double stable_s = 2.0);
int GuardedProbesForTesting();
// Whether a stored chunk (data then its 4-byte checksum, `size` bytes in all) passes the Fletcher32 filter's
// check exactly as HDF5 does it (the stored value or its byte-pair-swapped form, for files of HDF5 < 1.6.3).
bool HdfFletcher32ChunkOk(const uint8_t* chunk, size_t size);
// The same check, summed in pieces of `piece_words` 16-bit words of the data (0: one piece), calling
// piece_done(first_word, end_word) after each piece's words were added, while they are still in cache (the
// direct reader converts that piece's rows there). Its result does not depend on the pieces.
bool HdfFletcher32ChunkOk(const uint8_t* chunk, size_t size, size_t piece_words,
                          const std::function<void(size_t, size_t)>& piece_done);

class Hdf5TraceWriter final : public TraceSink {
 public:
  // Writes into a temporary file beside `path`; Finish() renames it into place. Destroying an unfinished
  // writer deletes the temporary file.
  static StatusOr<std::unique_ptr<Hdf5TraceWriter>> Create(const std::string& path,
                                                           Hdf5WriteOptions options = {});
  ~Hdf5TraceWriter() override;
  Status Begin(const TraceMeta& meta) override;
  Status WriteLayer(const LayerData& layer) override;
  Status Finish() override;

 private:
  Hdf5TraceWriter() = default;
  std::string path_, tmp_path_;
  Hdf5WriteOptions options_;
  long long file_ = -1;  // hid_t
  TraceMeta meta_;
  int next_layer_ = 0;
  bool began_ = false;
  bool finished_ = false;
  std::vector<uint16_t> scratch_;  // fp16 of the dataset being written
};

// Fast 64-bit content hash of a file (hex string), used for result provenance.
StatusOr<std::string> HashFile(const std::string& path);

// Whether the page cache holds all but at most 1% of the pages of regular file `path` (mincore over a
// read-only mapping that is never touched: no read, no I/O; milliseconds for 3 GB). False for anything else:
// a file it cannot open or map, an empty file, a pipe, and a file of another user the caller cannot write
// (the kernel then answers for this process's own page tables only). Decides whether hashing the trace beside
// the replay pays (analysis/sweep.h, HashConcurrently): only when the file need not stream from the disk.
bool FileInPageCache(const std::string& path);

}  // namespace kvsim
