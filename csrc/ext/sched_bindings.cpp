// Python bindings of the sm7x scheduling planner (module sm7x._sched).
//
// Inputs are any 1-D C-contiguous int32/int64 buffer (array.array, memoryview, numpy
// arrays, ...); they are validated and copied while the GIL is held, then the planner
// (sched.cpp, plain C++) runs without the GIL. Results are small read-only int32 objects
// that export the buffer protocol, so memoryview(), numpy.asarray() or
// torch.frombuffer() view them without a copy. Neither torch nor numpy is needed.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "sched.hpp"

namespace py = pybind11;
namespace sched = sm7x::sched;

namespace {

// ---------------------------------------------------------------------------------------
// Input: a 1-D C-contiguous buffer of int32 or int64, copied into int64 values.

bool host_is_little_endian() {
  const std::uint16_t one = 1;
  unsigned char first = 0;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

std::string shape_string(const std::vector<py::ssize_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

const char* const kAcceptedFormats =
    "expected a 1-D C-contiguous buffer of int32 or int64 in native byte order (struct "
    "format 'i', 'l' or 'q'), e.g. array.array('i', [...]), "
    "numpy.asarray(x, dtype=numpy.int32) or tensor.int().cpu().numpy()";

// Returns false if `format`/`itemsize` is not a native signed 4- or 8-byte integer.
bool is_int32_or_int64(const std::string& format, py::ssize_t itemsize) {
  char order = '@';
  char code = 0;
  if (format.size() == 1) {
    code = format[0];
  } else if (format.size() == 2) {
    order = format[0];
    code = format[1];
  } else {
    return false;
  }
  const bool little = host_is_little_endian();
  const bool native_order = order == '@' || order == '=' || (order == '<' && little) ||
                            ((order == '>' || order == '!') && !little);
  const bool signed_int = code == 'i' || code == 'l' || code == 'q' || code == 'n';
  return native_order && signed_int && (itemsize == 4 || itemsize == 8);
}

std::vector<std::int64_t> read_index_buffer(py::handle obj, const char* name) {
  if (!PyObject_CheckBuffer(obj.ptr())) {
    throw py::type_error(std::string(name) + " must support the buffer protocol, got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))) +
                         "; " + kAcceptedFormats);
  }
  // PyBUF_STRIDES | PyBUF_FORMAT: accept any layout here and report what is wrong below.
  const py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
  if (info.ndim != 1) {
    throw py::value_error(std::string(name) + " must be 1-D, got a " +
                          std::to_string(info.ndim) + "-D buffer of shape " +
                          shape_string(info.shape) + "; flatten it (e.g. .reshape(-1))");
  }
  if (!is_int32_or_int64(info.format, info.itemsize)) {
    throw py::value_error(std::string(name) + " has item format '" + info.format + "' (" +
                          std::to_string(info.itemsize) + "-byte items): " +
                          kAcceptedFormats);
  }
  const py::ssize_t n = info.shape[0];
  if (n > 1 && info.strides[0] != info.itemsize) {
    throw py::value_error(std::string(name) + " is not contiguous (stride of " +
                          std::to_string(info.strides[0]) + " bytes for " +
                          std::to_string(info.itemsize) +
                          "-byte items); pass a contiguous copy, e.g. "
                          "array.array('i', view) or numpy.ascontiguousarray(x)");
  }
  std::vector<std::int64_t> values(static_cast<std::size_t>(n));
  const auto* bytes = static_cast<const unsigned char*>(info.ptr);
  for (py::ssize_t i = 0; i < n; ++i) {
    // memcpy: a memoryview cast of a sliced bytes object can be misaligned.
    if (info.itemsize == 4) {
      std::int32_t v;
      std::memcpy(&v, bytes + i * 4, 4);
      values[static_cast<std::size_t>(i)] = v;
    } else {
      std::int64_t v;
      std::memcpy(&v, bytes + i * 8, 8);
      values[static_cast<std::size_t>(i)] = v;
    }
  }
  return values;
}

// ---------------------------------------------------------------------------------------
// Output: a read-only C-contiguous int32 array of one or two dimensions.

class Int32Buffer {
 public:
  Int32Buffer(std::string name, std::vector<std::int32_t> data,
              std::vector<py::ssize_t> shape)
      : name_(std::move(name)), data_(std::move(data)), shape_(std::move(shape)) {
    strides_.assign(shape_.size(), static_cast<py::ssize_t>(sizeof(std::int32_t)));
    for (std::size_t d = shape_.size(); d-- > 1;) strides_[d - 1] = strides_[d] * shape_[d];
  }
  virtual ~Int32Buffer() = default;

  py::buffer_info buffer_info() const {
    // An empty vector may have data() == nullptr; hand out a valid address anyway.
    const std::int32_t* ptr = data_.empty() ? &empty_ : data_.data();
    return py::buffer_info(const_cast<std::int32_t*>(ptr),
                           static_cast<py::ssize_t>(sizeof(std::int32_t)),
                           py::format_descriptor<std::int32_t>::format(),
                           static_cast<py::ssize_t>(shape_.size()), shape_, strides_,
                           /*readonly=*/true);
  }

  py::ssize_t length() const { return shape_.empty() ? 0 : shape_[0]; }
  const std::string& name() const { return name_; }

  py::tuple shape() const {
    py::tuple t(shape_.size());
    for (std::size_t d = 0; d < shape_.size(); ++d) t[d] = py::int_(shape_[d]);
    return t;
  }

  py::list tolist() const {
    py::list out;
    if (shape_.size() == 1) {
      for (std::int32_t v : data_) out.append(v);
      return out;
    }
    const py::ssize_t cols = shape_[1];
    for (py::ssize_t r = 0; r < shape_[0]; ++r) {
      py::list row;
      for (py::ssize_t c = 0; c < cols; ++c) {
        row.append(data_[static_cast<std::size_t>(r * cols + c)]);
      }
      out.append(std::move(row));
    }
    return out;
  }

  // Up to `limit` values, e.g. "[1, 2, 3, ...]".
  std::string preview(std::size_t limit = 8) const {
    std::ostringstream s;
    s << '[';
    for (std::size_t i = 0; i < data_.size() && i < limit; ++i) s << (i ? ", " : "") << data_[i];
    if (data_.size() > limit) s << ", ...";
    s << ']';
    return s.str();
  }

  std::string repr() const {
    return "Int32Buffer('" + name_ + "', shape=" + shape_string(shape_) + ", " + preview() + ")";
  }

 private:
  std::string name_;
  std::vector<std::int32_t> data_;
  std::vector<py::ssize_t> shape_;
  std::vector<py::ssize_t> strides_;
  std::int32_t empty_ = 0;
};

struct SplitPlan {
  std::shared_ptr<Int32Buffer> num_splits, split_offsets, partitions;
  std::int64_t total_splits, waves, max_chunk_blocks;
  std::int64_t num_heads, num_sms, block_n, max_splits;

  std::string repr() const {
    return "SplitPlan(batch=" + std::to_string(num_splits->length()) +
           ", total_splits=" + std::to_string(total_splits) +
           ", waves=" + std::to_string(waves) + ", num_splits=" + num_splits->preview() +
           ", num_heads=" + std::to_string(num_heads) + ", num_sms=" + std::to_string(num_sms) +
           ", block_n=" + std::to_string(block_n) + ")";
  }
};

std::shared_ptr<SplitPlan> py_split_kv_plan(py::object seqlens_k, std::int64_t num_heads,
                                            std::int64_t num_sms, std::int64_t block_n,
                                            std::int64_t max_splits) {
  std::vector<std::int64_t> lens = read_index_buffer(seqlens_k, "seqlens_k");
  sched::SplitKvPlan plan;
  {
    py::gil_scoped_release nogil;
    plan = sched::split_kv_plan(lens, num_heads, num_sms, block_n, max_splits);
  }
  const auto batch = static_cast<py::ssize_t>(lens.size());
  auto out = std::make_shared<SplitPlan>();
  out->num_splits =
      std::make_shared<Int32Buffer>("num_splits", std::move(plan.num_splits),
                                    std::vector<py::ssize_t>{batch});
  out->split_offsets =
      std::make_shared<Int32Buffer>("split_offsets", std::move(plan.split_offsets),
                                    std::vector<py::ssize_t>{batch + 1});
  out->partitions = std::make_shared<Int32Buffer>(
      "partitions", std::move(plan.partitions),
      std::vector<py::ssize_t>{static_cast<py::ssize_t>(plan.total_splits),
                               sched::kPartitionColumns});
  out->total_splits = plan.total_splits;
  out->waves = plan.waves;
  out->max_chunk_blocks = plan.max_chunk_blocks;
  out->num_heads = num_heads;
  out->num_sms = num_sms;
  out->block_n = block_n;
  out->max_splits = max_splits;
  return out;
}

const char* const kModuleDoc = R"doc(The split-KV planner of sm7x's serving kernels (CPU only, no torch or numpy needed).

split_kv_plan(seqlens_k, num_heads, num_sms, block_n=64, max_splits=128)
    FlashDecoding-style split-KV plan for a decode batch.

Inputs are 1-D C-contiguous int32 or int64 buffers (array.array('i'/'q'), memoryview,
numpy arrays, tensor.cpu().numpy()). Results are read-only int32 arrays exposed through
the buffer protocol: wrap them with memoryview(), numpy.asarray() or torch.frombuffer()
(no copy). Bad input raises ValueError (TypeError for objects that are not buffers).
)doc";

const char* const kInt32BufferDoc = R"doc(Read-only C-contiguous int32 array (1-D or 2-D) from the planners.

Exposes the buffer protocol (format 'i'): memoryview(buf), numpy.asarray(buf) and
torch.frombuffer(buf, dtype=torch.int32) view it without copying (read-only: torch warns
about that; .clone() the tensor before writing to it).)doc";

const char* const kSplitPlanDoc = R"doc(Split-KV (FlashDecoding) plan, from split_kv_plan().

num_splits     int32 (batch,): number of KV chunks of each sequence (>= 1)
split_offsets  int32 (batch + 1,): exclusive prefix sum of num_splits
partitions     int32 (total_splits, 3): rows (seq, kv_start, kv_end), grouped by sequence
               in order; the chunks of a sequence cover [0, len_k) contiguously, start on
               multiples of block_n and differ by at most one block in size
total_splits   total number of chunks
waves          estimated waves of CTAs: ceil(num_heads * total_splits / num_sms)
max_chunk_blocks  largest chunk, in KV blocks)doc";

}  // namespace

PYBIND11_MODULE(_sched, m, py::mod_gil_not_used()) {
  m.doc() = kModuleDoc;

  using BufferClass = py::class_<Int32Buffer, std::shared_ptr<Int32Buffer>>;
  BufferClass(m, "Int32Buffer", py::buffer_protocol(), kInt32BufferDoc)
      .def_buffer([](const Int32Buffer& b) { return b.buffer_info(); })
      .def("__len__", &Int32Buffer::length, "Number of rows (first dimension).")
      .def_property_readonly("shape", &Int32Buffer::shape, "Shape tuple.")
      .def_property_readonly("name", &Int32Buffer::name, "What the array holds.")
      .def("tolist", &Int32Buffer::tolist, "Copy into a (nested) list of ints.")
      .def("__repr__", &Int32Buffer::repr);

  py::class_<SplitPlan, std::shared_ptr<SplitPlan>>(m, "SplitPlan", kSplitPlanDoc)
      .def_property_readonly("num_splits", [](const SplitPlan& p) { return p.num_splits; })
      .def_property_readonly("split_offsets",
                             [](const SplitPlan& p) { return p.split_offsets; })
      .def_property_readonly("partitions", [](const SplitPlan& p) { return p.partitions; })
      .def_readonly("total_splits", &SplitPlan::total_splits)
      .def_readonly("waves", &SplitPlan::waves)
      .def_readonly("max_chunk_blocks", &SplitPlan::max_chunk_blocks)
      .def_readonly("num_heads", &SplitPlan::num_heads)
      .def_readonly("num_sms", &SplitPlan::num_sms)
      .def_readonly("block_n", &SplitPlan::block_n)
      .def_readonly("max_splits", &SplitPlan::max_splits)
      .def("__len__", [](const SplitPlan& p) { return p.num_splits->length(); },
           "Batch size.")
      .def("__repr__", &SplitPlan::repr);

  m.def("split_kv_plan", &py_split_kv_plan, py::arg("seqlens_k"), py::arg("num_heads"),
        py::arg("num_sms"), py::arg("block_n") = 64, py::arg("max_splits") = 128,
        R"doc(Plan FlashDecoding-style split-KV for a decode batch.

seqlens_k: 1-D int32/int64 buffer of per-sequence key lengths (>= 0).
num_heads: heads (one CTA per sequence, head and split); num_sms: SMs of the device;
block_n: keys per KV block (chunk boundaries are multiples of it); max_splits: cap per
sequence.

If batch * num_heads >= 0.8 * num_sms nothing is split. Otherwise a chunk size of C KV
blocks gives sequence i min(max_splits, max(1, ceil(nblocks_i / C))) splits; the C with
the smallest estimated makespan ceil(num_heads * total_splits / num_sms) *
max_i ceil(nblocks_i / splits_i) wins, ties toward fewer splits. Returns a SplitPlan.
Raises ValueError on invalid input.)doc");

  m.attr("__all__") = py::make_tuple("split_kv_plan", "SplitPlan", "Int32Buffer");
}
