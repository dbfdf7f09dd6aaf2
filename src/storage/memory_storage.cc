// MemoryStorage: an in-memory file tree that models durability like a POSIX file system.
//
// Files and directories are inodes (Node) shared by pointer: a directory entry refers to an
// inode, and so does every open file. An open file whose entry was renamed or removed keeps
// working on its inode, as on POSIX. Each file inode has volatile bytes (what reads see) and
// durable bytes (what Sync saved); each directory inode has volatile entries and durable
// entries (what SyncDir saved). SimulateCrash rebuilds the tree from the durable halves.
//
// Paths are normalised lexically: empty and "." components are dropped, ".." drops the
// component before it, and a leading '/' is optional (the tree has one root), so "d/x",
// "/d/x", "d//x/" and "d/./x" all name the same file.
#include "tessera/memory_storage.h"

#include <cerrno>
#include <cstring>
#include <limits>
#include <unordered_set>
#include <utility>

namespace tessera {
namespace {

struct Node {
  explicit Node(bool dir) : is_dir(dir) {}

  const bool is_dir;
  // Files.
  std::vector<uint8_t> data;          // volatile: what reads see
  std::vector<uint8_t> durable_data;  // what survives a crash
  // Directories: name -> inode.
  std::map<std::string, std::shared_ptr<Node>> entries;          // volatile
  std::map<std::string, std::shared_ptr<Node>> durable_entries;  // what survives a crash
};

using NodePtr = std::shared_ptr<Node>;

std::vector<std::string> Components(const std::string& path) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string::npos) j = path.size();
    std::string part = path.substr(i, j - i);
    if (part == "..") {
      if (!out.empty()) out.pop_back();
    } else if (!part.empty() && part != ".") {
      out.push_back(std::move(part));
    }
    i = j + 1;
  }
  return out;
}

}  // namespace

struct MemoryStorage::Impl {
  std::mutex mu;
  NodePtr root = std::make_shared<Node>(/*dir=*/true);
  // Incremented by SimulateCrash; files opened in an earlier epoch stop working, as the
  // process that held them is gone.
  uint64_t epoch = 0;

  // The inode at `comps`, or ENOENT / ENOTDIR. Requires `mu`.
  Result<NodePtr> Resolve(const std::vector<std::string>& comps, size_t n_comps,
                          const std::string& what) const {
    NodePtr node = root;
    for (size_t i = 0; i < n_comps; ++i) {
      if (!node->is_dir) return StatusFromErrno(what, ENOTDIR);
      auto it = node->entries.find(comps[i]);
      if (it == node->entries.end()) return StatusFromErrno(what, ENOENT);
      node = it->second;
    }
    return node;
  }
  Result<NodePtr> Resolve(const std::vector<std::string>& comps, const std::string& what) const {
    return Resolve(comps, comps.size(), what);
  }
  // The directory holding the last component of `comps` (which must not be empty).
  Result<NodePtr> ResolveParent(const std::vector<std::string>& comps,
                                const std::string& what) const {
    TESSERA_ASSIGN_OR_RETURN(NodePtr parent, Resolve(comps, comps.size() - 1, what));
    if (!parent->is_dir) return StatusFromErrno(what, ENOTDIR);
    return parent;
  }
};

namespace {

using Impl = MemoryStorage::Impl;

class MemoryWritableFile : public WritableFile {
 public:
  MemoryWritableFile(std::shared_ptr<Impl> impl, NodePtr node, std::string path, uint64_t epoch)
      : impl_(std::move(impl)), node_(std::move(node)), path_(std::move(path)), epoch_(epoch) {}
  ~MemoryWritableFile() override { Close().IgnoreError(); }

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    std::lock_guard<std::mutex> lock(impl_->mu);
    TESSERA_RETURN_IF_ERROR(CheckUsable("write to"));
    if (offset > std::numeric_limits<size_t>::max() - n) {
      return IOErrorFromErrno("write to " + path_ + " at offset " + std::to_string(offset), EFBIG);
    }
    const size_t end = static_cast<size_t>(offset) + n;
    if (node_->data.size() < end) node_->data.resize(end);  // zero-fills a gap
    if (n > 0) std::memcpy(node_->data.data() + offset, data, n);
    return Status::Ok();
  }

  Status Sync() override {
    std::lock_guard<std::mutex> lock(impl_->mu);
    TESSERA_RETURN_IF_ERROR(CheckUsable("sync"));
    node_->durable_data = node_->data;
    return Status::Ok();
  }

  Status Close() override {
    std::lock_guard<std::mutex> lock(impl_->mu);
    closed_ = true;
    return Status::Ok();
  }

  const std::string& path() const override { return path_; }

 private:
  // Requires impl_->mu.
  Status CheckUsable(const char* op) const {
    if (closed_) return FailedPrecondition(std::string(op) + " " + path_ + ": file is closed");
    if (epoch_ != impl_->epoch) {
      return FailedPrecondition(std::string(op) + " " + path_ +
                                ": file was opened before SimulateCrash");
    }
    return Status::Ok();
  }

  const std::shared_ptr<Impl> impl_;
  const NodePtr node_;
  const std::string path_;
  const uint64_t epoch_;
  bool closed_ = false;  // guarded by impl_->mu
};

class MemoryReadableFile : public ReadableFile {
 public:
  MemoryReadableFile(std::shared_ptr<Impl> impl, NodePtr node, std::string path, uint64_t size,
                     uint64_t epoch)
      : impl_(std::move(impl)),
        node_(std::move(node)),
        path_(std::move(path)),
        size_(size),
        epoch_(epoch) {}

  Status ReadAt(uint64_t offset, void* dst, size_t n) const override {
    if (offset > size_ || n > size_ - offset) {
      return DataLoss("read of " + path_ + " at offset " + std::to_string(offset) + " length " +
                      std::to_string(n) + " is past the end of the file (size " +
                      std::to_string(size_) + "; truncated?)");
    }
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (epoch_ != impl_->epoch) {
      return FailedPrecondition("read of " + path_ + ": file was opened before SimulateCrash");
    }
    const std::vector<uint8_t>& data = node_->data;
    if (offset + n > data.size()) {
      // The file shrank after it was opened.
      return DataLoss("read of " + path_ + " at offset " + std::to_string(offset) + " length " +
                      std::to_string(n) + " hit the end of the file at offset " +
                      std::to_string(data.size()) + " (size " + std::to_string(size_) +
                      " when opened; truncated?)");
    }
    if (n > 0) std::memcpy(dst, data.data() + offset, n);
    return Status::Ok();
  }

  uint64_t size() const override { return size_; }
  const std::string& path() const override { return path_; }

 private:
  const std::shared_ptr<Impl> impl_;
  const NodePtr node_;
  const std::string path_;
  const uint64_t size_;
  const uint64_t epoch_;
};

// Drops what is volatile in the tree under `node`. `visited` guards against an inode reached
// twice (renames can leave an inode in two durable entries, even in a cycle).
void ResetToDurable(const NodePtr& node, std::unordered_set<const Node*>& visited) {
  if (!visited.insert(node.get()).second) return;
  if (!node->is_dir) {
    node->data = node->durable_data;
    return;
  }
  node->entries = node->durable_entries;
  for (const auto& [name, child] : node->entries) ResetToDurable(child, visited);
}

}  // namespace

MemoryStorage::MemoryStorage() : impl_(std::make_shared<Impl>()) {}
MemoryStorage::~MemoryStorage() = default;

Result<std::unique_ptr<WritableFile>> MemoryStorage::NewWritableFile(const std::string& path,
                                                                     CreateMode mode) {
  const std::string what = "open " + path + " for writing";
  const std::vector<std::string> comps = Components(path);
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (comps.empty()) return StatusFromErrno(what, EISDIR);
  TESSERA_ASSIGN_OR_RETURN(NodePtr parent, impl_->ResolveParent(comps, what));
  NodePtr& slot = parent->entries[comps.back()];
  if (slot == nullptr) {
    slot = std::make_shared<Node>(/*dir=*/false);
  } else if (mode != CreateMode::kTruncate) {
    return StatusFromErrno(what + " as a new file", EEXIST);
  } else if (slot->is_dir) {
    return StatusFromErrno(what, EISDIR);
  } else {
    slot->data.clear();  // O_TRUNC: same inode, durable bytes unchanged until Sync
  }
  return std::unique_ptr<WritableFile>(
      std::make_unique<MemoryWritableFile>(impl_, slot, path, impl_->epoch));
}

Result<std::unique_ptr<ReadableFile>> MemoryStorage::NewReadableFile(const std::string& path) {
  const std::string what = "open " + path + " for reading";
  const std::vector<std::string> comps = Components(path);
  std::lock_guard<std::mutex> lock(impl_->mu);
  TESSERA_ASSIGN_OR_RETURN(NodePtr node, impl_->Resolve(comps, what));
  if (node->is_dir) return StatusFromErrno(what, EISDIR);
  const uint64_t size = node->data.size();
  return std::unique_ptr<ReadableFile>(
      std::make_unique<MemoryReadableFile>(impl_, std::move(node), path, size, impl_->epoch));
}

Status MemoryStorage::CreateDirs(const std::string& path) {
  const std::vector<std::string> comps = Components(path);
  std::lock_guard<std::mutex> lock(impl_->mu);
  NodePtr node = impl_->root;
  std::string so_far;
  for (const std::string& name : comps) {
    so_far += "/" + name;
    NodePtr& slot = node->entries[name];
    if (slot == nullptr) {
      slot = std::make_shared<Node>(/*dir=*/true);
    } else if (!slot->is_dir) {
      return IOErrorFromErrno("mkdir " + path + " (" + so_far + " exists and is not a directory)",
                              EEXIST);
    }
    node = slot;
  }
  return Status::Ok();
}

Result<FileType> MemoryStorage::Stat(const std::string& path) {
  const std::vector<std::string> comps = Components(path);
  std::lock_guard<std::mutex> lock(impl_->mu);
  Result<NodePtr> node = impl_->Resolve(comps, "stat " + path);
  if (!node.ok()) return FileType::kNotFound;  // ENOENT or ENOTDIR
  return (*node)->is_dir ? FileType::kDirectory : FileType::kFile;
}

Result<std::vector<std::string>> MemoryStorage::ListDir(const std::string& dir) {
  const std::string what = "opendir " + dir;
  const std::vector<std::string> comps = Components(dir);
  std::lock_guard<std::mutex> lock(impl_->mu);
  TESSERA_ASSIGN_OR_RETURN(NodePtr node, impl_->Resolve(comps, what));
  if (!node->is_dir) return StatusFromErrno(what, ENOTDIR);
  std::vector<std::string> names;
  names.reserve(node->entries.size());
  for (const auto& [name, child] : node->entries) names.push_back(name);  // map: sorted
  return names;
}

Status MemoryStorage::Rename(const std::string& from, const std::string& to) {
  const std::string what = "rename " + from + " to " + to;
  const std::vector<std::string> from_comps = Components(from);
  const std::vector<std::string> to_comps = Components(to);
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (from_comps.empty() || to_comps.empty()) return StatusFromErrno(what, EBUSY);
  TESSERA_ASSIGN_OR_RETURN(NodePtr from_parent, impl_->ResolveParent(from_comps, what));
  auto from_it = from_parent->entries.find(from_comps.back());
  if (from_it == from_parent->entries.end()) return StatusFromErrno(what, ENOENT);
  const NodePtr node = from_it->second;
  TESSERA_ASSIGN_OR_RETURN(NodePtr to_parent, impl_->ResolveParent(to_comps, what));
  auto to_it = to_parent->entries.find(to_comps.back());
  if (to_it != to_parent->entries.end()) {
    const NodePtr& target = to_it->second;
    if (target == node) return Status::Ok();  // the same inode: nothing to do
    if (node->is_dir && !target->is_dir) return StatusFromErrno(what, ENOTDIR);
    if (!node->is_dir && target->is_dir) return StatusFromErrno(what, EISDIR);
    if (target->is_dir && !target->entries.empty()) return StatusFromErrno(what, ENOTEMPTY);
  }
  if (node->is_dir && to_comps.size() > from_comps.size() &&
      std::equal(from_comps.begin(), from_comps.end(), to_comps.begin())) {
    return StatusFromErrno(what, EINVAL);  // a directory into its own subtree
  }
  to_parent->entries[to_comps.back()] = node;
  from_parent->entries.erase(from_comps.back());
  return Status::Ok();
}

Status MemoryStorage::RenameNoReplace(const std::string& from, const std::string& to) {
  const std::string what = "rename " + from + " to " + to + " without replacing";
  const std::vector<std::string> from_comps = Components(from);
  const std::vector<std::string> to_comps = Components(to);
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (from_comps.empty() || to_comps.empty()) return StatusFromErrno(what, EBUSY);
  TESSERA_ASSIGN_OR_RETURN(NodePtr from_parent, impl_->ResolveParent(from_comps, what));
  auto from_it = from_parent->entries.find(from_comps.back());
  if (from_it == from_parent->entries.end()) return StatusFromErrno(what, ENOENT);
  TESSERA_ASSIGN_OR_RETURN(NodePtr to_parent, impl_->ResolveParent(to_comps, what));
  if (to_parent->entries.count(to_comps.back())) return StatusFromErrno(what, EEXIST);
  const NodePtr node = from_it->second;
  if (node->is_dir && to_comps.size() > from_comps.size() &&
      std::equal(from_comps.begin(), from_comps.end(), to_comps.begin())) {
    return StatusFromErrno(what, EINVAL);  // a directory into its own subtree
  }
  to_parent->entries[to_comps.back()] = node;
  from_parent->entries.erase(from_comps.back());
  return Status::Ok();
}

Status MemoryStorage::Remove(const std::string& path) {
  const std::string what = "unlink " + path;
  const std::vector<std::string> comps = Components(path);
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (comps.empty()) return StatusFromErrno(what, EISDIR);
  TESSERA_ASSIGN_OR_RETURN(NodePtr parent, impl_->ResolveParent(comps, what));
  auto it = parent->entries.find(comps.back());
  if (it == parent->entries.end()) return StatusFromErrno(what, ENOENT);
  if (it->second->is_dir) return StatusFromErrno(what, EISDIR);
  parent->entries.erase(it);
  return Status::Ok();
}

Status MemoryStorage::RemoveDir(const std::string& path) {
  const std::string what = "rmdir " + path;
  const std::vector<std::string> comps = Components(path);
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (comps.empty()) return StatusFromErrno(what, EBUSY);
  TESSERA_ASSIGN_OR_RETURN(NodePtr parent, impl_->ResolveParent(comps, what));
  auto it = parent->entries.find(comps.back());
  if (it == parent->entries.end()) return StatusFromErrno(what, ENOENT);
  if (!it->second->is_dir) return StatusFromErrno(what, ENOTDIR);
  if (!it->second->entries.empty()) return StatusFromErrno(what, ENOTEMPTY);
  parent->entries.erase(it);
  return Status::Ok();
}

// Every capability, as POSIX (Publish is Storage's, through RenameNoReplace).
StorageCapabilities MemoryStorage::capabilities() const {
  return StorageCapabilities{.rename = true,
                             .positional_writes = true,
                             .directory_sync = true,
                             .conditional_create = true};
}

Status MemoryStorage::SyncDir(const std::string& dir) {
  const std::string what = "open directory " + dir;
  const std::vector<std::string> comps = Components(dir);
  std::lock_guard<std::mutex> lock(impl_->mu);
  TESSERA_ASSIGN_OR_RETURN(NodePtr node, impl_->Resolve(comps, what));
  if (!node->is_dir) return StatusFromErrno(what, ENOTDIR);
  node->durable_entries = node->entries;
  return Status::Ok();
}

void MemoryStorage::SimulateCrash() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::unordered_set<const Node*> visited;
  ResetToDurable(impl_->root, visited);
  ++impl_->epoch;
}

Result<std::vector<uint8_t>> MemoryStorage::GetFileContents(const std::string& path) {
  const std::string what = "read " + path;
  const std::vector<std::string> comps = Components(path);
  std::lock_guard<std::mutex> lock(impl_->mu);
  TESSERA_ASSIGN_OR_RETURN(NodePtr node, impl_->Resolve(comps, what));
  if (node->is_dir) return StatusFromErrno(what, EISDIR);
  return node->data;
}

void MemoryStorage::SetFileContents(const std::string& path, std::vector<uint8_t> contents) {
  const std::vector<std::string> comps = Components(path);
  if (comps.empty()) return;  // the root is a directory
  std::lock_guard<std::mutex> lock(impl_->mu);
  // Every directory on the way exists, durably linked into its parent.
  NodePtr node = impl_->root;
  for (size_t i = 0; i + 1 < comps.size(); ++i) {
    NodePtr& slot = node->entries[comps[i]];
    if (slot == nullptr || !slot->is_dir) slot = std::make_shared<Node>(/*dir=*/true);
    node->durable_entries[comps[i]] = slot;
    node = slot;
  }
  NodePtr& slot = node->entries[comps.back()];
  if (slot == nullptr || slot->is_dir) slot = std::make_shared<Node>(/*dir=*/false);
  slot->durable_data = contents;
  slot->data = std::move(contents);
  node->durable_entries[comps.back()] = slot;
}

}  // namespace tessera
