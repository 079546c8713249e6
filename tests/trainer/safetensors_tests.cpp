// The safetensors reader takes untrusted files: every damaged or crafted one is refused with an
// std::invalid_argument that names the problem, never a crash or a read outside the file.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <fstream>
#include <random>

#include "model/safetensors.h"

namespace {

using fsdp::io::SafetensorsFile;

std::string temp_path(const std::string& name) { return "/tmp/fsdp-st-" + std::to_string(getpid()) + "-" + name; }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

void spit(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// A valid file of three tensors (float32 [4, 3], bfloat16 [5], int64 scalar).
std::string sample_file() {
  const std::string path = temp_path("sample.safetensors");
  std::vector<at::Tensor> tensors = {torch::arange(12, torch::kFloat).view({4, 3}),
                                     torch::linspace(0, 1, 5).to(torch::kBFloat16), torch::tensor(7, torch::kLong)};
  fsdp::io::write_safetensors(path,
                              {{"a", at::kFloat, {4, 3}}, {"b", at::kBFloat16, {5}}, {"c", at::kLong, {}}},
                              [&](size_t i) { return tensors[i]; }, {{"format", "pt"}});
  return path;
}

// A file with `header` as its JSON and `data` after it.
std::string crafted(const std::string& header, size_t data_bytes = 48) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(uint64_t(header.size()) >> (8 * i));
  return bytes + header + std::string(data_bytes, '\0');
}

void expect_refused(const std::string& bytes, const std::string& needle) {
  const std::string path = temp_path("bad.safetensors");
  spit(path, bytes);
  try {
    SafetensorsFile file(path);
    FAIL() << "accepted; expected: " << needle;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << "names the file: " << e.what();
  }
  unlink(path.c_str());
}

TEST(Safetensors, RoundTripAndRowRanges) {
  const std::string path = sample_file();
  SafetensorsFile file(path);
  ASSERT_EQ(file.entries().size(), 3u);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_TRUE(torch::equal(file.read_rows("a", 1, 2, at::kFloat), torch::arange(3, 9, torch::kFloat).view({2, 3})));
  EXPECT_TRUE(torch::equal(file.read_rows("a", 0, 4, at::kDouble), torch::arange(12, torch::kDouble).view({4, 3})));
  EXPECT_TRUE(torch::equal(file.read_rows("b", 0, 5, at::kBFloat16), torch::linspace(0, 1, 5).to(torch::kBFloat16)));
  EXPECT_EQ(file.read_rows("c", 0, 1, at::kLong).item<int64_t>(), 7);
  EXPECT_THROW(file.read_rows("a", 3, 2, at::kFloat), std::invalid_argument);
  EXPECT_THROW(file.read_rows("missing", 0, 1, at::kFloat), std::invalid_argument);
  unlink(path.c_str());
}

TEST(Safetensors, NamedDamageIsRefused) {
  const std::string good = slurp(sample_file());
  expect_refused(good.substr(0, 5), "shorter than the 8-byte header length");
  expect_refused(good.substr(0, good.size() - 1), "outside the file");
  std::string huge = good;
  huge[7] = 0x10;
  expect_refused(huge, "over the");
  expect_refused(crafted("{\"a\":"), "not valid JSON");
  expect_refused(crafted("[1,2]"), "not a JSON object");
  expect_refused(crafted(std::string(40, '[') + std::string(40, ']')), "nests deeper than 32 levels");
  expect_refused(crafted(R"({"a":{"dtype":"F8_E9","shape":[1],"data_offsets":[0,1]}})"), "unsupported dtype 'F8_E9'");
  expect_refused(crafted(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})"), "not a count");
  expect_refused(crafted(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})"), "make 12 bytes but data_offsets hold 8");
  expect_refused(crafted(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[40,56]}})"), "outside the file's 48 data bytes");
  expect_refused(crafted(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})"), "outside the file");
  expect_refused(crafted(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                         R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})"),
                 "overlap");
  expect_refused(crafted(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})"),
                 "overflows");
  expect_refused(crafted(R"({"a":{"shape":[1],"data_offsets":[0,4]}})"), "no dtype");
  expect_refused(crafted(R"({"__metadata__":{"format":1}})"), "is not a string");
}

// 20,000 files with random bytes changed (mostly in the header, where the offsets are), or cut
// short: each is refused with invalid_argument or, if still well-formed, every tensor reads.
TEST(Safetensors, FuzzedFilesAreRefusedOrRead) {
  const std::string good = slurp(sample_file());
  const uint64_t header_end = 8 + (static_cast<uint8_t>(good[0]) | static_cast<uint8_t>(good[1]) << 8);
  std::mt19937 rng(2024);
  const std::string path = temp_path("fuzz.safetensors");
  int refused = 0, read = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % 8 == 0 ? rng() % bytes.size() : rng() % header_end;
      bytes[at] = static_cast<char>(rng() % 4 == 0 ? "0123456789[]{},:\""[rng() % 17] : rng());
    }
    if (rng() % 10 == 0) bytes.resize(rng() % bytes.size());
    spit(path, bytes);
    try {
      SafetensorsFile file(path);
      for (const auto& [name, entry] : file.entries()) {
        const int64_t rows = entry.shape.empty() ? 1 : entry.shape[0];
        file.read_rows(name, 0, rows, at::kDouble);
      }
      ++read;
    } catch (const std::invalid_argument&) {
      ++refused;
    }
  }
  unlink(path.c_str());
  std::printf("fuzzed safetensors files: %d refused, %d still well-formed and read\n", refused, read);
  EXPECT_GT(refused, 10000);
}

}  // namespace
