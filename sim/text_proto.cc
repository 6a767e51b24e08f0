#include "sim/text_proto.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

namespace kvsim {
namespace {

class Collector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (first_.empty())
      first_ = "line " + std::to_string(line + 1) + ", column " + std::to_string(column + 1) + ": " + message;
  }
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

}  // namespace

Status ParseTextProto(const std::string& text, const std::string& what, google::protobuf::Message* msg) {
  google::protobuf::TextFormat::Parser parser;
  Collector errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, msg))
    return Status::InvalidArgument(what + ": " + (errors.first().empty() ? "cannot parse" : errors.first()) +
                                   " (expected a " + msg->GetDescriptor()->full_name() + " in text format)");
  return Status::Ok();
}

StatusOr<std::string> ReadTextProtoFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    return Status::InvalidArgument(path + ": is a folder, not a text-proto file (name the .textproto file)");
  std::ifstream in(path);
  if (!in) return Status::NotFound(path + ": cannot open file (check the path)");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Status ParseTextProtoFile(const std::string& path, google::protobuf::Message* msg) {
  KVSIM_ASSIGN_OR_RETURN(std::string text, ReadTextProtoFile(path));
  return ParseTextProto(text, path, msg);
}

Status SetFieldFromString(const std::string& assignment, google::protobuf::Message* msg) {
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    return Status::InvalidArgument("--set '" + assignment + "': expected key=value");
  std::string key = assignment.substr(0, eq);
  const std::string value = assignment.substr(eq + 1);
  google::protobuf::Message* target = msg;
  for (size_t dot; (dot = key.find('.')) != std::string::npos;) {
    const auto* f = target->GetDescriptor()->FindFieldByName(key.substr(0, dot));
    if (!f || f->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE || f->is_repeated())
      return Status::InvalidArgument("--set '" + assignment + "': no message field '" + key.substr(0, dot) +
                                     "'");
    target = target->GetReflection()->MutableMessage(target, f);
    key = key.substr(dot + 1);
  }
  const auto* desc = target->GetDescriptor();
  const auto* field = desc->FindFieldByName(key);
  if (!field) {
    std::string names;
    for (int i = 0; i < desc->field_count(); ++i) names += (i ? ", " : "") + desc->field(i)->name();
    return Status::InvalidArgument("--set '" + assignment + "': " + desc->name() + " has no parameter '" +
                                   key + "' (parameters: " + (names.empty() ? "none" : names) + ")");
  }
  if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE)
    return Status::InvalidArgument("--set '" + assignment + "': '" + key + "' is not a scalar parameter");
  if (field->is_repeated()) {
    // A list replaces the whole field: "key=1,2,3" or "key=[1, 2, 3]".
    std::string list = value;
    if (!list.empty() && list.front() == '[') list.erase(0, 1);
    if (!list.empty() && list.back() == ']') list.pop_back();
    std::unique_ptr<google::protobuf::Message> scratch(target->New());
    std::string text;
    std::stringstream items(list);
    for (std::string item; std::getline(items, item, ',');) {
      if (item.find_first_not_of(" \t") == std::string::npos) continue;
      if (field->type() == google::protobuf::FieldDescriptor::TYPE_STRING &&
          item.find('"') == std::string::npos)
        item = "\"" + item + "\"";
      text += key + ": " + item + " ";
    }
    if (!google::protobuf::TextFormat::MergeFromString(text, scratch.get()))
      return Status::InvalidArgument("--set '" + assignment + "': '" + value +
                                     "' is not a comma-separated list of " + field->type_name() + " for '" +
                                     key + "'");
    target->GetReflection()->ClearField(target, field);
    target->MergeFrom(*scratch);
    return Status::Ok();
  }
  std::string literal = value;
  if (field->type() == google::protobuf::FieldDescriptor::TYPE_STRING && (value.empty() || value[0] != '"'))
    literal = "\"" + value + "\"";
  if (!google::protobuf::TextFormat::ParseFieldValueFromString(literal, field, target))
    return Status::InvalidArgument("--set '" + assignment + "': '" + value + "' is not a valid " +
                                   field->type_name() + " for '" + key + "'");
  return Status::Ok();
}

std::string ToTextWithDefaults(const google::protobuf::Message& msg) {
  // Print every singular field, set or not, so results show the values actually used.
  std::unique_ptr<google::protobuf::Message> copy(msg.New());
  copy->CopyFrom(msg);
  const auto* desc = copy->GetDescriptor();
  const auto* refl = copy->GetReflection();
  for (int i = 0; i < desc->field_count(); ++i) {
    const auto* f = desc->field(i);
    if (f->is_repeated() || refl->HasField(*copy, f) || !f->has_presence()) continue;
    using FD = google::protobuf::FieldDescriptor;
    switch (f->cpp_type()) {
      case FD::CPPTYPE_INT32:
        refl->SetInt32(copy.get(), f, refl->GetInt32(*copy, f));
        break;
      case FD::CPPTYPE_INT64:
        refl->SetInt64(copy.get(), f, refl->GetInt64(*copy, f));
        break;
      case FD::CPPTYPE_UINT32:
        refl->SetUInt32(copy.get(), f, refl->GetUInt32(*copy, f));
        break;
      case FD::CPPTYPE_UINT64:
        refl->SetUInt64(copy.get(), f, refl->GetUInt64(*copy, f));
        break;
      case FD::CPPTYPE_DOUBLE:
        refl->SetDouble(copy.get(), f, refl->GetDouble(*copy, f));
        break;
      case FD::CPPTYPE_FLOAT:
        refl->SetFloat(copy.get(), f, refl->GetFloat(*copy, f));
        break;
      case FD::CPPTYPE_BOOL:
        refl->SetBool(copy.get(), f, refl->GetBool(*copy, f));
        break;
      case FD::CPPTYPE_ENUM:
        refl->SetEnum(copy.get(), f, refl->GetEnum(*copy, f));
        break;
      case FD::CPPTYPE_STRING:
        refl->SetString(copy.get(), f, refl->GetString(*copy, f));
        break;
      case FD::CPPTYPE_MESSAGE:
        break;
    }
  }
  google::protobuf::TextFormat::Printer printer;
  printer.SetSingleLineMode(true);
  std::string out;
  printer.PrintToString(*copy, &out);
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

}  // namespace kvsim
