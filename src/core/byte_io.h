// Little-endian binary encoding helpers for the messages ranks exchange (plans, results).
// ByteReader checks every length against the buffer and reports truncation as kDataLoss.
#ifndef TESSERA_CORE_BYTE_IO_H_
#define TESSERA_CORE_BYTE_IO_H_

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tessera/status.h"

namespace tessera {

class ByteWriter {
 public:
  explicit ByteWriter(std::vector<uint8_t>* out) : out_(out) {}

  template <typename T>
  void Put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    size_t at = out_->size();
    out_->resize(at + sizeof(T));
    std::memcpy(out_->data() + at, &value, sizeof(T));
  }
  void PutBytes(const void* data, size_t n) {
    size_t at = out_->size();
    out_->resize(at + n);
    if (n) std::memcpy(out_->data() + at, data, n);
  }
  void PutString(std::string_view s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    PutBytes(s.data(), s.size());
  }
  template <typename T>
  void PutVector(const std::vector<T>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    PutBytes(v.data(), v.size() * sizeof(T));
  }

 private:
  std::vector<uint8_t>* out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> in) : in_(in) {}

  template <typename T>
  Status Get(T* value) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (in_.size() - pos_ < sizeof(T)) return Truncated();
    std::memcpy(value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }
  Status GetString(std::string* s) {
    uint32_t n = 0;
    TESSERA_RETURN_IF_ERROR(Get(&n));
    if (in_.size() - pos_ < n) return Truncated();
    s->assign(reinterpret_cast<const char*>(in_.data() + pos_), n);
    pos_ += n;
    return Status::Ok();
  }
  template <typename T>
  Status GetVector(std::vector<T>* v) {
    uint32_t n = 0;
    TESSERA_RETURN_IF_ERROR(Get(&n));
    if ((in_.size() - pos_) / sizeof(T) < n) return Truncated();
    v->resize(n);
    if (n) std::memcpy(v->data(), in_.data() + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
    return Status::Ok();
  }
  bool AtEnd() const { return pos_ == in_.size(); }
  size_t position() const { return pos_; }

 private:
  Status Truncated() const {
    return DataLoss("message truncated at byte " + std::to_string(pos_) + " of " +
                    std::to_string(in_.size()));
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
};

}  // namespace tessera

#endif  // TESSERA_CORE_BYTE_IO_H_
