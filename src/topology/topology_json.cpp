// The JSON file format of a topology (docs/topology.md): parsing and dumping. Parse errors name
// the file, the JSON path of the value and what was expected, e.g. "t.json: $.levels[1].latency_us:
// expected a number > 0, got \"fast\"". Files are parsed strictly: duplicate keys, numbers beyond
// a double and absurd nesting are errors too. Built where nlohmann_json is (topology_json_none.cpp
// elsewhere).
#include <cmath>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "topology/topology_detail.hpp"
#include "treeattn/topology.hpp"

namespace treeattn {
namespace {

using nlohmann::json;
using topology_detail::fmt_double;
using topology_detail::kMaxCount;

// Short rendering of a JSON value for error messages.
std::string show(const json& v) {
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

// Reads fields of one JSON object, remembering the path for error messages.
class ObjectReader {
 public:
  ObjectReader(const json& obj, std::string source, std::string path)
      : obj_(obj), source_(std::move(source)), path_(std::move(path)) {}

  Status fail(std::string_view key, std::string_view what) const {
    return invalid_argument(source_ + ": " + path_ + (key.empty() ? "" : "." + std::string(key)) +
                            ": " + std::string(what));
  }
  Status check_object() const {
    if (!obj_.is_object()) return fail("", "expected an object, got " + show(obj_));
    return Status::ok();
  }
  Status check_keys(std::initializer_list<std::string_view> known) const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      bool ok = false;
      std::string list;
      for (std::string_view k : known) {
        if (k == it.key()) ok = true;
        list += (list.empty() ? "" : ", ") + std::string(k);
      }
      if (!ok) return fail(it.key(), "unknown key (known keys: " + list + ")");
    }
    return Status::ok();
  }
  bool has(std::string_view key) const { return obj_.contains(std::string(key)); }

  Status number(std::string_view key, bool required, double& out, double min_exclusive,
                bool allow_equal_min = false) const {
    if (!has(key)) return required ? fail(key, "missing (expected a number)") : Status::ok();
    const json& v = obj_.at(std::string(key));
    const std::string bound =
        std::string(allow_equal_min ? ">= " : "> ") + fmt_double(min_exclusive);
    if (!v.is_number()) return fail(key, "expected a number " + bound + ", got " + show(v));
    const double d = v.get<double>();
    const bool in_range =
        std::isfinite(d) && (allow_equal_min ? d >= min_exclusive : d > min_exclusive);
    if (!in_range) return fail(key, "expected a number " + bound + ", got " + show(v));
    out = d;
    return Status::ok();
  }
  Status integer(std::string_view key, bool required, int& out, int min, int max) const {
    if (!has(key)) return required ? fail(key, "missing (expected an integer)") : Status::ok();
    const json& v = obj_.at(std::string(key));
    const std::string range = "in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
    if (!v.is_number_integer())
      return fail(key, "expected an integer " + range + ", got " + show(v));
    const auto i = v.get<int64_t>();
    if (i < min || i > max) return fail(key, "expected an integer " + range + ", got " + show(v));
    out = static_cast<int>(i);
    return Status::ok();
  }
  Status string(std::string_view key, bool required, std::string& out) const {
    if (!has(key)) return required ? fail(key, "missing (expected a string)") : Status::ok();
    const json& v = obj_.at(std::string(key));
    if (!v.is_string()) return fail(key, "expected a string, got " + show(v));
    out = v.get<std::string>();
    return Status::ok();
  }
  const json& at(std::string_view key) const { return obj_.at(std::string(key)); }
  ObjectReader child(std::string_view key) const {
    return {obj_.at(std::string(key)), source_, path_ + "." + std::string(key)};
  }
  const std::string& source() const { return source_; }
  const std::string& path() const { return path_; }

 private:
  const json& obj_;
  std::string source_;
  std::string path_;
};

// Topology files are three levels deep; anything far deeper is not one, and a value nested tens
// of thousands of levels deep would overflow the stack when it is printed or compared.
constexpr std::size_t kMaxDepth = 64;

// Builds the document through nlohmann's SAX interface (its parser is iterative) and rejects,
// with the JSON path of the value, what the plain parser would accept or throw on: nesting deeper
// than kMaxDepth, a key given twice in one object (the plain parser keeps the last silently), and
// a number that does not fit a double (1e400, a 5000-digit integer: an out_of_range exception).
class StrictSax : public nlohmann::json_sax<json> {
 public:
  explicit StrictSax(json& out) : dom_(out, false) {}

  bool null() override { return value() && dom_.null(); }
  bool boolean(bool v) override { return value() && dom_.boolean(v); }
  bool number_integer(number_integer_t v) override { return value() && dom_.number_integer(v); }
  bool number_unsigned(number_unsigned_t v) override { return value() && dom_.number_unsigned(v); }
  bool number_float(number_float_t v, const string_t& s) override {
    return value() && dom_.number_float(v, s);
  }
  bool string(string_t& v) override { return value() && dom_.string(v); }
  bool binary(binary_t& v) override { return value() && dom_.binary(v); }
  bool start_object(std::size_t n) override {
    if (!value() || !open(false)) return false;
    return dom_.start_object(n);
  }
  bool key(string_t& k) override {
    Frame& f = frames_.back();
    const bool first = f.keys.insert(k).second;
    f.key = k;
    if (!first) {
      error_ = path() + ": duplicate key (each key may appear once per object)";
      return false;
    }
    return dom_.key(k);
  }
  bool end_object() override {
    frames_.pop_back();
    return dom_.end_object();
  }
  bool start_array(std::size_t n) override {
    if (!value() || !open(true)) return false;
    return dom_.start_array(n);
  }
  bool end_array() override {
    frames_.pop_back();
    return dom_.end_array();
  }
  bool parse_error(std::size_t, const std::string& token,
                   const nlohmann::detail::exception& ex) override {
    if (ex.id == 406) {  // out_of_range: number overflow
      std::string shown = token.size() > 40 ? token.substr(0, 37) + "..." : token;
      error_ = path() + ": the number " + shown + " (" + std::to_string(token.size()) +
               " characters) does not fit in a double";
    } else {
      // what() is "[json.exception.parse_error.101] parse error at line 3, column 5: ..."
      std::string what = ex.what();
      const auto pos = what.find("] ");
      if (pos != std::string::npos) what = what.substr(pos + 2);
      error_ = "not valid JSON: " + what;
    }
    return false;
  }
  const std::string& error() const { return error_; }

 private:
  struct Frame {
    bool array = false;
    std::size_t count = 0;  // elements begun (arrays)
    std::string key;        // the current key (objects)
    std::set<std::string> keys;
  };
  // A value begins in the current container: count array elements for the path.
  bool value() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().count;
    return true;
  }
  bool open(bool array) {
    if (frames_.size() >= kMaxDepth) {
      std::string where = path();
      if (where.size() > 60) where = where.substr(0, 57) + "...";
      error_ = where + ": nested deeper than " + std::to_string(kMaxDepth) +
               " levels (a topology file has 3)";
      return false;
    }
    frames_.push_back(Frame{array, 0, {}, {}});
    return true;
  }
  std::string path() const {
    std::string p = "$";
    for (const Frame& f : frames_) {
      if (f.array) {
        if (f.count > 0) p += "[" + std::to_string(f.count - 1) + "]";
      } else if (!f.key.empty()) {
        p += "." + f.key;
      }
    }
    return p;
  }

  nlohmann::detail::json_sax_dom_parser<json> dom_;
  std::vector<Frame> frames_;
  std::string error_;
};

Status parse_strict_json(std::string_view text, const std::string& source, json& out) {
  StrictSax sax(out);
  bool ok = false;
  try {
    ok = json::sax_parse(text.begin(), text.end(), &sax);
  } catch (const std::exception& e) {  // the SAX handler never throws; belt and braces
    return invalid_argument(source + ": not valid JSON: " + e.what());
  }
  if (!ok || !sax.error().empty())
    return invalid_argument(source + ": " +
                            (sax.error().empty() ? std::string("not valid JSON") : sax.error()));
  return Status::ok();
}

Status parse_level(const ObjectReader& r, std::string_view expected_name, LinkLevel& out) {
  TREEATTN_RETURN_IF_ERROR(r.check_object());
  TREEATTN_RETURN_IF_ERROR(r.check_keys({"name", "latency_us", "bandwidth_GBps", "links_per_node",
                                         "call_overhead_us", "user_op_overhead_us"}));
  TREEATTN_RETURN_IF_ERROR(r.string("name", true, out.name));
  if (out.name != expected_name) {
    return r.fail("name", "expected \"" + std::string(expected_name) +
                              "\" at this position, got \"" + out.name +
                              "\" (levels are [node] or [node, network])");
  }
  TREEATTN_RETURN_IF_ERROR(r.number("latency_us", true, out.latency_us, 0));
  TREEATTN_RETURN_IF_ERROR(r.number("bandwidth_GBps", true, out.bandwidth_GBps, 0));
  out.links_per_node = 1;
  TREEATTN_RETURN_IF_ERROR(r.integer("links_per_node", false, out.links_per_node, 1, kMaxCount));
  out.call_overhead_us = 0;
  TREEATTN_RETURN_IF_ERROR(r.number("call_overhead_us", false, out.call_overhead_us, 0, true));
  out.user_op_overhead_us = 0;
  TREEATTN_RETURN_IF_ERROR(
      r.number("user_op_overhead_us", false, out.user_op_overhead_us, 0, true));
  if (expected_name == "node" && out.links_per_node != 1)
    return r.fail("links_per_node",
                  "only the network level has links a node's ranks share (the node level's "
                  "bandwidth is per rank)");
  if (expected_name == "node" && out.call_overhead_us != 0)
    return r.fail("call_overhead_us",
                  "only the network level has a call overhead (use "
                  "collective_overhead_us for calls inside a node)");
  return Status::ok();
}

}  // namespace

Result<Topology> parse_topology_json(std::string_view text, std::string_view source_sv) {
  const std::string source(source_sv);
  json doc;
  TREEATTN_RETURN_IF_ERROR(parse_strict_json(text, source, doc));
  const ObjectReader r(doc, source, "$");
  TREEATTN_RETURN_IF_ERROR(r.check_object());
  TREEATTN_RETURN_IF_ERROR(
      r.check_keys({"format", "name", "description", "nodes", "ranks_per_node", "collectives",
                    "collective_overhead_us", "memory", "compute", "levels", "sources"}));
  Topology t;
  std::string format;
  TREEATTN_RETURN_IF_ERROR(r.string("format", true, format));
  if (format != Topology::kFormat)
    return r.fail("format",
                  "expected \"" + std::string(Topology::kFormat) + "\", got \"" + format + "\"");
  TREEATTN_RETURN_IF_ERROR(r.string("name", true, t.name));
  TREEATTN_RETURN_IF_ERROR(r.string("description", false, t.description));
  TREEATTN_RETURN_IF_ERROR(r.integer("nodes", true, t.nodes, 1, kMaxCount));
  TREEATTN_RETURN_IF_ERROR(r.integer("ranks_per_node", true, t.ranks_per_node, 1, kMaxCount));
  std::string lib = "mpi";
  TREEATTN_RETURN_IF_ERROR(r.string("collectives", false, lib));
  if (lib == "mpi") {
    t.collectives = CollectiveLibrary::kMpi;
  } else if (lib == "nccl") {
    t.collectives = CollectiveLibrary::kNccl;
  } else {
    return r.fail("collectives", "expected \"mpi\" or \"nccl\", got \"" + lib + "\"");
  }
  TREEATTN_RETURN_IF_ERROR(
      r.number("collective_overhead_us", false, t.collective_overhead_us, 0, true));

  if (!r.has("memory")) return r.fail("memory", "missing (expected {\"bandwidth_GBps\": ...})");
  {
    const ObjectReader m = r.child("memory");
    TREEATTN_RETURN_IF_ERROR(m.check_object());
    TREEATTN_RETURN_IF_ERROR(m.check_keys({"bandwidth_GBps", "capacity_GB"}));
    TREEATTN_RETURN_IF_ERROR(m.number("bandwidth_GBps", true, t.memory_bandwidth_GBps, 0));
    if (m.has("capacity_GB")) {
      double c = 0;
      TREEATTN_RETURN_IF_ERROR(m.number("capacity_GB", true, c, 0));
      t.memory_capacity_GB = c;
    }
  }
  if (r.has("compute")) {
    const ObjectReader c = r.child("compute");
    TREEATTN_RETURN_IF_ERROR(c.check_object());
    TREEATTN_RETURN_IF_ERROR(
        c.check_keys({"peak_TFLOPs", "kernel_overhead_us", "max_concurrent_ranks"}));
    if (c.has("peak_TFLOPs")) {
      double f = 0;
      TREEATTN_RETURN_IF_ERROR(c.number("peak_TFLOPs", true, f, 0));
      t.peak_tflops = f;
    }
    TREEATTN_RETURN_IF_ERROR(c.number("kernel_overhead_us", false, t.kernel_overhead_us, 0, true));
    TREEATTN_RETURN_IF_ERROR(
        c.integer("max_concurrent_ranks", false, t.max_concurrent_ranks, 0, kMaxCount));
  }

  if (!r.has("levels")) return r.fail("levels", "missing (expected [node] or [node, network])");
  const json& levels = r.at("levels");
  if (!levels.is_array() || levels.empty() || levels.size() > 2) {
    return r.fail("levels", "expected an array of 1 or 2 levels ([node] or [node, network]), got " +
                                show(levels));
  }
  for (std::size_t i = 0; i < levels.size(); ++i) {
    const ObjectReader lr(levels[i], source, "$.levels[" + std::to_string(i) + "]");
    if (i == 0) {
      TREEATTN_RETURN_IF_ERROR(parse_level(lr, "node", t.node));
    } else {
      LinkLevel net;
      TREEATTN_RETURN_IF_ERROR(parse_level(lr, "network", net));
      t.network = net;
    }
  }
  if (t.nodes > 1 && !t.network) {
    return r.fail("levels", "nodes is " + std::to_string(t.nodes) +
                                ", so a second level {\"name\": \"network\", ...} is required");
  }
  if (r.has("sources")) {
    const json& s = r.at("sources");
    if (!s.is_array()) return r.fail("sources", "expected an array of strings, got " + show(s));
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (!s[i].is_string())
        return invalid_argument(source + ": $.sources[" + std::to_string(i) +
                                "]: expected a string, got " + show(s[i]));
      t.sources.push_back(s[i].get<std::string>());
    }
  }
  Status st = t.validate();
  if (!st.is_ok()) return invalid_argument(source + ": " + st.message());
  return t;
}

std::string topology_to_json(const Topology& t) {
  json j = json::object();
  j["format"] = Topology::kFormat;
  j["name"] = t.name;
  if (!t.description.empty()) j["description"] = t.description;
  j["nodes"] = t.nodes;
  j["ranks_per_node"] = t.ranks_per_node;
  j["collectives"] = collective_library_name(t.collectives);
  j["collective_overhead_us"] = t.collective_overhead_us;
  json mem = {{"bandwidth_GBps", t.memory_bandwidth_GBps}};
  if (t.memory_capacity_GB) mem["capacity_GB"] = *t.memory_capacity_GB;
  j["memory"] = mem;
  json comp = {{"kernel_overhead_us", t.kernel_overhead_us},
               {"max_concurrent_ranks", t.max_concurrent_ranks}};
  if (t.peak_tflops) comp["peak_TFLOPs"] = *t.peak_tflops;
  j["compute"] = comp;
  json levels = json::array();
  auto level = [](const LinkLevel& l, bool with_links) {
    json o = {{"name", l.name}, {"latency_us", l.latency_us}, {"bandwidth_GBps", l.bandwidth_GBps}};
    if (with_links) o["links_per_node"] = l.links_per_node;
    if (l.call_overhead_us != 0) o["call_overhead_us"] = l.call_overhead_us;
    if (l.user_op_overhead_us != 0) o["user_op_overhead_us"] = l.user_op_overhead_us;
    return o;
  };
  levels.push_back(level(t.node, false));
  if (t.network) levels.push_back(level(*t.network, true));
  j["levels"] = levels;
  if (!t.sources.empty()) j["sources"] = t.sources;
  return j.dump(2) + "\n";
}

}  // namespace treeattn
