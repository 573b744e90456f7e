// src/reference/precision.hpp must give the verdict of every row of
// verdict_table.txt (python/kvcomp/compare.py is held to the same table by
// test_verdict_table.py). The table's format is described at its top.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <map>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "three_way.hpp"

namespace kvcomp::test {
namespace {

struct Row {
  int line = 0;
  std::string name, rule, dtype;
  std::map<std::string, double> options;
  bool pass = true;
  std::string reason;  // the reason a FAIL must give (a prefix), may be empty
  std::vector<double> a, b, c;
  std::string text;  // the row as written
};

void PrintTo(const Row& r, std::ostream* os) { *os << "verdict_table.txt:" << r.line << ": " << r.text; }

std::string trim(const std::string& s) {
  const auto first = s.find_first_not_of(' ');
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(' ') - first + 1);
}

std::vector<double> parse_values(const std::string& field) {
  std::vector<double> out;
  if (trim(field) == "-") return out;
  std::istringstream in(field);
  std::string token;
  while (in >> token) {
    const auto star = token.find('*');
    const double v = std::strtod(token.substr(0, star).c_str(), nullptr);
    const long n = star == std::string::npos ? 1 : std::strtol(token.c_str() + star + 1, nullptr, 10);
    out.insert(out.end(), static_cast<std::size_t>(n), v);
  }
  return out;
}

std::vector<Row> load_table() {
  std::ifstream in(KVCOMP_VERDICT_TABLE);
  if (!in) throw std::runtime_error("cannot open " KVCOMP_VERDICT_TABLE);
  std::vector<Row> rows;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (trim(line).empty() || line[0] == '#') continue;
    std::vector<std::string> f;
    for (std::size_t at = 0;;) {
      const auto bar = line.find(" | ", at);
      f.push_back(line.substr(at, bar == std::string::npos ? std::string::npos : bar - at));
      if (bar == std::string::npos) break;
      at = bar + 3;
    }
    if (f.size() != 6)
      throw std::runtime_error("verdict_table.txt:" + std::to_string(number) + ": not 6 fields");
    Row r;
    r.line = number;
    r.text = line;
    r.name = trim(f[0]);
    std::istringstream how(f[1]);
    how >> r.rule >> r.dtype;
    for (std::string opt; how >> opt;) {
      const auto eq = opt.find('=');
      r.options[opt.substr(0, eq)] = std::strtod(opt.c_str() + eq + 1, nullptr);
    }
    const std::string verdict = trim(f[2]);
    r.pass = verdict == "PASS";
    if (!r.pass && verdict.rfind("FAIL", 0) != 0)
      throw std::runtime_error("verdict_table.txt:" + std::to_string(number) + ": verdict " + verdict);
    if (const auto colon = verdict.find(':'); colon != std::string::npos)
      r.reason = trim(verdict.substr(colon + 1));
    r.a = parse_values(f[3]);
    r.b = parse_values(f[4]);
    r.c = parse_values(f[5]);
    rows.push_back(std::move(r));
  }
  return rows;
}

const std::vector<Row>& table() {
  static const std::vector<Row> rows = load_table();
  return rows;
}

DType parse_dtype(const std::string& key) {
  if (key == "bf16") return DType::bf16;
  if (key == "fp16") return DType::f16;
  if (key == "fp32") return DType::f32;
  throw std::runtime_error("unknown dtype key " + key);
}

struct Verdict {
  bool pass;
  std::string why, summary;
};

Verdict verdict(const Row& r) {
  const DType dt = parse_dtype(r.dtype);
  if (r.rule == "three_way") {
    const ThreeWayResult res = three_way_compare(r.a, r.b, r.c, dt);
    return {res.pass, res.why, res.summary()};
  }
  if (r.rule == "two_way") {
    EXPECT_TRUE(r.b.empty()) << "two_way rows have no B";
    TwoWayThresholds tol = two_way_thresholds(dt);
    if (r.options.count("rtol")) tol.rtol = r.options.at("rtol");
    if (r.options.count("atol")) tol.atol = r.options.at("atol");
    const double pct_thd = r.options.count("pct_thd") ? r.options.at("pct_thd") : 0.005;
    const TwoWayResult res = two_way_compare(r.a, r.c, tol, pct_thd);
    return {res.pass, res.why, res.summary()};
  }
  if (r.rule == "fp32_projection") {
    const AccuracyResult res = fp32_projection_accuracy(r.a, r.b, r.c, dt);
    return {res.pass, res.why, res.why};
  }
  throw std::runtime_error("unknown rule " + r.rule);
}

class VerdictTable : public ::testing::TestWithParam<Row> {};

TEST_P(VerdictTable, SameVerdictAsTheTable) {
  const Row& r = GetParam();
  const Verdict v = verdict(r);
  EXPECT_EQ(v.pass, r.pass) << v.summary;
  EXPECT_EQ(v.why.rfind(r.reason, 0), 0u)
      << "reason '" << v.why << "' does not start with '" << r.reason << "'";
}

std::string row_test_name(const ::testing::TestParamInfo<Row>& info) {
  std::string s = "line" + std::to_string(info.param.line) + "_";
  for (char ch : info.param.name) s += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Rows, VerdictTable, ::testing::ValuesIn(table()), row_test_name);

TEST(VerdictTableFile, CoversEveryRuleBothWays) {
  for (const char* rule : {"three_way", "two_way", "fp32_projection"}) {
    bool pass = false, fail = false;
    for (const Row& r : table())
      if (r.rule == rule) (r.pass ? pass : fail) = true;
    EXPECT_TRUE(pass && fail) << rule << ": the table needs PASS and FAIL rows";
  }
}

}  // namespace
}  // namespace kvcomp::test
