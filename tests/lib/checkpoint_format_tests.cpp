// The checkpoint metadata reader takes untrusted bytes: every mangled file is refused with a
// CheckpointError, never a crash, a hang or an allocation of a size the file only claims.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "checkpoint/checkpoint_format.h"

namespace {

using fsdp::io::CheckpointError;
using fsdp::io::CheckpointMeta;

CheckpointMeta sample() {
  CheckpointMeta m;
  m.library_version = "fsdp.cpp test";
  m.world = 3;
  m.sharded = {{"tok_emb.weight", 6 /* float */, {64, 32}, {1, 2, 3}, {}},
               {"norm.weight", 15 /* bfloat16 */, {32}, {4, 5, 6}, {}},
               {"scale", 6, {}, {7, 8, 9}, {}}};
  m.replicated = {{"adam.step.scale", 6, {}, {}, {}, std::string(4, '\x01')},
                  {"rng", 0 /* byte */, {5}, {}, {}, "abcde"}};
  m.extra = {{"step", "120"}, {"data", "synthetic"}};
  return m;
}

// The sample under tensor parallelism: the embedding's blocks placed (rank 2 holds two runs of
// rows and half the columns, rank 1 nothing).
CheckpointMeta placed_sample() {
  CheckpointMeta m = sample();
  m.sharded[0].places = {{{{0, 32}}, 0, 32}, {{}, 0, 32}, {{{32, 16}, {56, 8}}, 16, 16}};
  return m;
}

uint32_t version_of(const std::string& bytes) {
  uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 8, 4);
  return version;
}

// A valid checksum over changed content: what a deliberately crafted file looks like.
std::string reseal(std::string bytes) {
  if (bytes.size() < 4) return bytes;
  const uint32_t crc = fsdp::io::crc32(bytes.data(), bytes.size() - 4);
  std::memcpy(bytes.data() + bytes.size() - 4, &crc, 4);
  return bytes;
}

// The checksums older checkpoints hold are the standard CRC-32 (its check value); a sum continued
// over pieces equals the whole's, and one flipped bit changes it.
TEST(CheckpointFormat, Crc32IsTheStandardOneAndContinuesOverPieces) {
  EXPECT_EQ(fsdp::io::crc32("123456789", 9), 0xCBF43926u);
  std::string bytes(1 << 20, '\0');
  std::mt19937 random(7);
  for (char& c : bytes) c = static_cast<char>(random());
  const uint32_t whole = fsdp::io::crc32(bytes.data(), bytes.size());
  EXPECT_EQ(fsdp::io::crc32(bytes.data() + 1000, bytes.size() - 1000, fsdp::io::crc32(bytes.data(), 1000)), whole);
  bytes[12345] ^= 1;
  EXPECT_NE(fsdp::io::crc32(bytes.data(), bytes.size()), whole);
}

TEST(CheckpointFormat, RoundTrip) {
  const CheckpointMeta m = sample();
  const CheckpointMeta back = fsdp::io::decode(fsdp::io::encode(m), "metadata.bin");
  EXPECT_EQ(back.library_version, m.library_version);
  EXPECT_EQ(back.world, 3u);
  ASSERT_EQ(back.sharded.size(), 3u);
  EXPECT_EQ(back.sharded[0].shape, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(back.sharded[1].block_crcs, (std::vector<uint32_t>{4, 5, 6}));
  EXPECT_EQ(back.replicated[1].bytes, "abcde");
  EXPECT_EQ(back.extra, m.extra);
}

// Placed blocks (format version 2) come back as written; a file without them stays version 1,
// which builds before placement read.
TEST(CheckpointFormat, PlacedBlocksRoundTripAsVersion2) {
  EXPECT_EQ(version_of(fsdp::io::encode(sample())), 1u);
  const CheckpointMeta m = placed_sample();
  const std::string bytes = fsdp::io::encode(m);
  EXPECT_EQ(version_of(bytes), 2u);
  const CheckpointMeta back = fsdp::io::decode(bytes, "metadata.bin");
  EXPECT_EQ(back.sharded[0].places, m.sharded[0].places);
  EXPECT_TRUE(back.sharded[1].places.empty());
  EXPECT_EQ(back.sharded[0].places[2].rows(), 24);
}

TEST(CheckpointFormat, PlacesOutsideTheTensorAreRefused) {
  for (const auto& bad : {fsdp::io::BlockPlace{{{60, 8}}, 0, 32}, fsdp::io::BlockPlace{{{0, 8}}, 24, 16},
                          fsdp::io::BlockPlace{{{-1, 2}}, 0, 32}}) {
    CheckpointMeta m = placed_sample();
    m.sharded[0].places[1] = bad;
    try {
      fsdp::io::decode(fsdp::io::encode(m), "ck/metadata.bin");
      ADD_FAILURE() << "accepted";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("tensor 'tok_emb.weight' places"), std::string::npos) << e.what();
    }
  }
}

TEST(CheckpointFormat, DamageIsNamed) {
  const std::string good = fsdp::io::encode(sample());
  auto error_of = [](const std::string& bytes) -> std::string {
    try {
      fsdp::io::decode(bytes, "ck/metadata.bin");
    } catch (const CheckpointError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  std::string flipped = good;
  flipped[40] ^= 1;
  EXPECT_EQ(error_of(flipped), "ck/metadata.bin: checksum mismatch: the file is damaged or was cut short");
  EXPECT_NE(error_of(good.substr(0, good.size() / 2)).find("checksum mismatch"), std::string::npos);
  EXPECT_NE(error_of("not a checkpoint").find("no FSDPCKPT header"), std::string::npos);
  std::string huge_count = good;  // the sharded-tensor count, resealed: claims 4 billion entries
  const size_t count_at = 8 + 4 + 4 + sample().library_version.size() + 4;
  std::memset(huge_count.data() + count_at, 0xFF, 4);
  EXPECT_NE(error_of(reseal(huge_count)).find("claims 4294967295 sharded tensors"), std::string::npos);
}

TEST(CheckpointFormat, FuzzedMetadataIsRefusedCleanly) {
  const std::string samples[] = {fsdp::io::encode(sample()), fsdp::io::encode(placed_sample())};
  std::mt19937 rng(1122);
  int refused = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const std::string& good = samples[trial % 2];
    std::string bytes = good;
    switch (rng() % 4) {
      case 0:  // flipped bits
        for (int k = 1 + rng() % 4; k > 0; --k) bytes[rng() % bytes.size()] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1:  // cut short
        bytes.resize(rng() % bytes.size());
        break;
      case 2: {  // a length or size field made huge or negative
        const size_t at = rng() % (bytes.size() - 8);
        const uint64_t value = rng() % 2 ? ~uint64_t{0} : uint64_t{1} << (20 + rng() % 44);
        std::memcpy(bytes.data() + at, &value, 4 + 4 * (rng() % 2));
        break;
      }
      default:  // junk inserted
        bytes.insert(rng() % bytes.size(), std::string(1 + rng() % 16, static_cast<char>(rng())));
    }
    if (rng() % 2) bytes = reseal(bytes);  // half of them get past the checksum to the parser
    try {
      fsdp::io::decode(bytes, "fuzz");  // resealed changes to names or CRC values decode: the loader checks those
    } catch (const CheckpointError&) {
      ++refused;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "trial " << trial << ": not a CheckpointError: " << e.what();
    }
  }
  EXPECT_GT(refused, 15000);
}

}  // namespace
