#pragma once
// Protobuf text-format parsing with errors that name the file, line, column and problem.

#include <google/protobuf/message.h>

#include <string>

#include "sim/status.h"

namespace kvsim {

Status ParseTextProto(const std::string& text, const std::string& what, google::protobuf::Message* msg);
// The text of a text-proto file; one-line errors for a missing file or a folder.
StatusOr<std::string> ReadTextProtoFile(const std::string& path);
Status ParseTextProtoFile(const std::string& path, google::protobuf::Message* msg);
// Sets one field by name ("window=16", "pooling=MAX_POOL"), text-format value syntax. Nested fields with
// dots.
Status SetFieldFromString(const std::string& assignment, google::protobuf::Message* msg);
// Text format on one line, defaults included for proto2 fields.
std::string ToTextWithDefaults(const google::protobuf::Message& msg);

}  // namespace kvsim
