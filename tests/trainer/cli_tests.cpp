// fsdp-train's command line: every bad flag is one UsageError that names it and the fix, and no
// command line, however mangled, gets anything else (a crash, another exception, a huge allocation).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <sys/stat.h>

#include <fstream>
#include <random>

#include "train/args.h"
#include "train/config_file.h"

namespace {

using fsdp::train::TrainArgs;
using fsdp::train::UsageError;

TrainArgs checked(const std::vector<std::string>& argv) {
  TrainArgs a = fsdp::train::parse_train_args(argv);
  fsdp::train::check_train_args_on_this_machine(a);
  return a;
}

// A file NAME in the test's temporary directory holding `text`; its path.
std::string temp_file(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

std::string usage_error_of(const std::vector<std::string>& argv) {
  try {
    checked(argv);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(TrainArgs, BadFlagsAreUsageErrorsThatNameTheFlag) {
  using ::testing::HasSubstr;
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--steps", "abc"}, "--steps: 'abc' is not an integer"},
      {{"--steps", "0"}, "--steps must be at least 1"},
      {{"--steps", "99999999999"}, "--steps: '99999999999' is not an integer in range"},
      {{"--seed", "-1"}, "--seed: '-1' is not an integer"},
      {{"--lr", "nan"}, "--lr: 'nan' is not a number"},
      {{"--lr", "-1"}, "--lr must be positive"},
      {{"--min-lr", "1"}, "--min-lr must be between 0 and --lr"},
      {{"--bogus"}, "unknown flag '--bogus'"},
      {{"--steps"}, "--steps needs a value"},
      {{"--model", "huge"}, "--model: unknown model preset 'huge'"},
      {{"--param-dtype", "fp8"}, "dtype must be fp32, bf16 or auto, not 'fp8'"},
      {{"--backend", "gloo"}, "--backend must be auto, mpi or nccl"},
      {{"--attention", "cudnn"}, "--attention: attention kernel must be aten or flash, not 'cudnn'"},
      {{"--fp8", "e4m3"}, "--fp8: float8 recipe must be off, tensorwise or rowwise, not 'e4m3'"},
      {{"--profile", "/tmp/p", "--steps", "2", "--profile-steps", "3"}, "--profile-steps must be between 1 and --steps"},
      {{"--data", "/nonexistent"}, "--data: cannot read '/nonexistent': No such file or directory"},
      {{"--data", "/dev/null"}, "--data: '/dev/null' is not a regular file"},
      {{"--attention-mask", "sliding"}, "--attention-mask must be causal or block_causal, not 'sliding'"},
      {{"--eos-id", "10"}, "--eos-id needs --attention-mask block_causal (the documents it separates)"},
      {{"--attention-mask", "block_causal"},
       "--attention-mask block_causal needs the id that ends a document, and the tiny model names none: pass --eos-id"},
      {{"--attention-mask", "block_causal", "--eos-id", "300"},
       "--eos-id 300 is outside the tiny model's vocabulary of 256 ids"},
      {{"--data", "/"}, "--data: '/' is a directory without .bin files"},
      {{"--model", "tiny", "--data", "/proc/self/status"},
       "holds 0 sequence(s) of --seq 128 + 1 tokens and the run needs 1: lower --seq or use more data"},
      {{"--log", "/proc/x/y"}, "--log: cannot write '/proc/x/y': the directory '/proc/x' does not exist"},
      {{"--log", "/"}, "--log: '/' exists and is not a file"},
      {{"--trace", "/nonexistent/t"}, "--trace: cannot write '/nonexistent/t-rank0.json'"},
      {{"--model", "small", "--batch", "65536", "--seq", "2048"}, "lower --batch or --seq, or add --recompute"},
      {{"--seq", "600"}, "--seq 600 is more than the tiny model's 512 positions: lower --seq"},
      {{"--memory-budget", "-1"}, "--memory-budget must be a positive number of GiB"},
      {{"--plan-only"}, "--plan-only needs --memory-budget"},
      {{"--memory-budget", "8", "--recompute"}, "--memory-budget chooses which blocks are recomputed"},
      {{"--memory-budget", "8", "--bucket-mb", "4"}, "drop --bucket-mb"},
      {{"--plan-check", "/tmp/p.jsonl", "--bucket-mb", "4", "--reduce-bucket-max-wait", "1"},
       "--plan-check chooses the buckets"},
      // Flags that another flag gives meaning to: never silently ignored.
      {{"--reduce-bucket-max-wait", "1"}, "--reduce-bucket-max-wait needs --bucket-mb"},
      {{"--trace-steps", "3"}, "--trace-steps needs --trace"},
      {{"--profile-steps", "1"}, "--profile-steps needs --profile"},
      {{"--eval-every", "2"}, "--eval-every needs --eval-data"},
      {{"--eval-batches", "2"}, "--eval-batches needs --eval-data"},
      {{"--save-every", "2"}, "--save-every needs --save-dir"},
      {{"--grad-accum-sync", "every"}, "--grad-accum-sync needs --grad-accum 2 or more"},
      {{"--plan-check-rounds", "3"}, "--plan-check-rounds needs --plan-check"},
      {{"--max-pending-host-steps", "3"}, "--max-pending-host-steps needs --cpu-offload and --optimizer-in-backward"},
      {{"--overwrite"}, "--overwrite needs --save-dir, --export or --log"},
      {{"--overwrite-log"}, "--overwrite-log needs --log"},
      {{"--timeout", "1e300"}, "--timeout must be 0 (default) or from 0.001 seconds (1 ms) to 604800"},
      {{"--export", "/tmp/x", "--export-shard-gb", "1e10"}, "--export-shard-gb must be positive and at most 1000000"},
      {{"--overwrite-checkpoints"}, "--overwrite-checkpoints needs --save-dir"},
      {{"--overwrite-export", "--save-dir", "/tmp/x"}, "--overwrite-export needs --export"},
      {{"--allow-resume-changes"}, "--allow-resume-changes needs --resume"},
      {{"--seq", "16", "--seq", "32"}, "--seq is given twice: give it once"},
      {{"--seq=16", "--seq", "32"}, "--seq is given twice: give it once"},
      {{"--recompute=yes"}, "--recompute takes no value: give it alone"},
      {{"--steps="}, "--steps: '' is not an integer"},
      {{"--bogus=1"}, "unknown flag '--bogus'"},
      {{"--timeout", "0.0009"}, "--timeout must be 0 (default) or from 0.001 seconds"},
      {{"--backend", "mpi", "--memory-snapshot", "/tmp/s"}, "--memory-snapshot records the GPU allocator's history"},
      {{"--backend", "mpi", "--attention", "flash"}, "--attention flash chooses a GPU kernel"},
      {{"--max-skipped-steps", "-1"}, "--max-skipped-steps must be 0"},
      {{"--max-skipped-steps", "2", "--optimizer-in-backward", "--clip", "0"}, "--max-skipped-steps cannot skip"},
      {{"--resume", "/nonexistent"}, "--resume: '/nonexistent' holds no complete checkpoint"},
      {{"--export", "/proc"}, "--export: '/proc' already holds files: pass --overwrite-export"},
      {{"--export", "/nonexistent/x.safetensors"},
       "--export: cannot write '/nonexistent/x.safetensors': the directory '/nonexistent' does not exist"},
      {{"--export", "/dev/null"}, "--export: '/dev/null' exists and is not a directory"},
      {{"--reduce-bucket-max-wait", "-1"}, "--reduce-bucket-max-wait must be 0 or more"},
      {{"--max-pending-host-steps", "-1"}, "--max-pending-host-steps must be 0 or more"},
      {{"--optimizer-in-backward"}, "add --clip 0"},
      {{"--optimizer-in-backward", "--clip", "0", "--grad-accum", "2", "--grad-accum-sync", "every"},
       "use --grad-accum-sync last"},
      {{"--memory-budget", "8", "--optimizer-in-backward", "--clip", "0"}, "drop --optimizer-in-backward"},
      {{"--memory-budget", "8", "--replicas", "2"}, "drop --replicas"},
      {{"--replicas", "0"}, "--replicas must be at least 1"},
      {{"--replicas", "2"}, "--replicas 2 does not divide the 1 ranks"},
      {{"--memory-budget", "8", "--steps", "5"}, "--steps must be at least 6"},
      {{"--plan-check", "/tmp/p.jsonl", "--steps", "4"}, "--steps must be at least 5"},
      {{"--plan-check", "/tmp/p.jsonl", "--plan-check-steps", "2"}, "--plan-check-steps must be at least 3"},
      {{"--plan-check", "/tmp/p.jsonl", "--plan-check-rounds", "0"}, "--plan-check-rounds must be at least 1"},
  };
  for (const auto& [argv, message] : cases) EXPECT_THAT(usage_error_of(argv), HasSubstr(message)) << argv[0];
}

TEST(TrainArgs, DefaultsAndAGoodCommandLineAreAccepted) {
  EXPECT_EQ(usage_error_of({}), "(accepted)");
  const std::string log = ::testing::TempDir() + "fsdp_cli_test.jsonl";
  EXPECT_EQ(usage_error_of({"--model", "tiny", "--steps", "3", "--log", log}), "(accepted)");
  const TrainArgs a = checked({"--steps", "7", "--seq=32", "--recompute", "--dry-run"});
  EXPECT_EQ(a.steps, 7);
  EXPECT_EQ(a.seq, 32);  // --flag=value as --flag value
  EXPECT_TRUE(a.recompute && a.dry_run);
  EXPECT_TRUE(checked({"--checkpoint"}).recompute);  // the flag's old name, until 0.8
}

// One rule for every output: never a path the run reads or another output, never a file inside a
// model or checkpoint the run reads, nothing inside a directory --export replaces. Refused before
// anything is opened: the files are left as they were.
TEST(TrainArgs, NoOutputIsAnInputOrAnotherOutput) {
  using ::testing::HasSubstr;
  const std::string dir = ::testing::TempDir() + "apart/";
  ::mkdir(dir.c_str(), 0755);
  ::mkdir((dir + "model").c_str(), 0755);
  const std::string data = dir + "data.bin", config = dir + "run.json";
  std::ofstream(data) << "tokens";
  std::ofstream(config) << R"({"steps": 3})";
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"--data", data, "--log", data}, "--log '" + data + "' would destroy --data '" + data + "'"},
      {{"--data", data, "--save-init", data}, "--save-init '" + data + "' would destroy --data"},
      {{"--config", config, "--log", config}, "--log '" + config + "' would destroy --config"},
      {{"--init-from", dir + "model", "--log", dir + "model/model.safetensors"}, "(it lies inside it)"},
      {{"--resume", dir + "model", "--memory-log", dir + "model/m"}, "--memory-log '" + dir + "model/m-rank0.jsonl' would destroy --resume"},
      {{"--log", dir + "t-rank0.json", "--trace", dir + "t"}, "--log '" + dir + "t-rank0.json' would write over --trace"},
      {{"--save-init", dir + "w.safetensors", "--export", dir + "w.safetensors"}, "--save-init '" + dir + "w.safetensors' would write over --export"},
      {{"--export", dir + "out", "--log", dir + "out/log.jsonl"}, "--export '" + dir + "out' would replace --log"},
      {{"--save-dir", data, "--data", data}, "--save-dir '" + data + "' would destroy --data"},
  };
  for (const auto& [argv, message] : refused) {
    const std::string error = usage_error_of(argv);
    EXPECT_THAT(error, HasSubstr("give each output a path of its own")) << argv.back();
    EXPECT_THAT(error, HasSubstr(message)) << argv.back();
  }
  std::ifstream in(data);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "tokens");
  EXPECT_EQ(usage_error_of({"--log", dir + "model.jsonl", "--save-init", dir + "init.safetensors"}), "(accepted)");
}

// --config: a JSON object of flags, which the command line overrides; a run's given flags written
// beside its log read back as the same arguments.
TEST(TrainArgs, AConfigFileGivesFlagsTheCommandLineOverrides) {
  using ::testing::HasSubstr;
  const std::string dir = ::testing::TempDir();
  const std::string good = temp_file("cli_config.json", R"({"steps": 7, "seq": "32", "lr": 0.001, "recompute": true,
                                                         "cpu-offload": false})");
  const TrainArgs a = checked({"--config", good, "--seq=16"});
  EXPECT_EQ(a.steps, 7);
  EXPECT_EQ(a.seq, 16);  // the command line's
  EXPECT_DOUBLE_EQ(a.lr, 0.001);
  EXPECT_TRUE(a.recompute);
  EXPECT_FALSE(a.cpu_offload);
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"--config", temp_file("c1.json", R"({"bogus": 1})")}, "unknown flag 'bogus'"},
      {{"--config", temp_file("c2.json", R"({"recompute": "yes"})")}, "'recompute' is a switch: give true or false"},
      {{"--config", temp_file("c3.json", R"({"steps": [1]})")}, "'steps' needs a string or a number"},
      {{"--config", temp_file("c4.json", R"({"steps": 0})")}, "--steps must be at least 1"},
      {{"--config", temp_file("c5.json", R"({"steps": "x"})")}, "--steps (from --config"},
      {{"--config", temp_file("c6.json", R"([1, 2])")}, "is not a JSON object of flags"},
      {{"--config", temp_file("c7.json", "{")}, "is not a JSON object of flags"},
      {{"--config", temp_file("c8.json", R"({"config": "x.json"})")}, "a --config cannot name another"},
      {{"--config", dir + "missing.json"}, "--config: cannot read"},
      {{"--config", temp_file("c9.json", R"({"steps": 3, "lr": 0.1, "steps": 4})")}, "gives 'steps' twice: give each flag once"},
      {{"--config", temp_file("c10.json", R"({"steps": 3, "training": {"steps": 4}})")},
       "gives 'steps' twice: give each flag once"},
      {{"--config", dir}, "is a directory, not a JSON file of flags"},
      {{"--config"}, "--config needs a value"},
      {{"--steps", "3", "--steps=4"}, "--steps is given twice"},
  };
  for (const auto& [argv, message] : refused) EXPECT_THAT(usage_error_of(argv), HasSubstr(message)) << argv.back();
  // What a run writes beside its log is a --config giving the same flags.
  const TrainArgs given = checked({"--steps", "5", "--recompute", "--lr=0.002"});
  const std::string written = temp_file("given.json", fsdp::train::given_flags_json(given));
  const TrainArgs again = checked({"--config", written});
  EXPECT_EQ(again.steps, 5);
  EXPECT_TRUE(again.recompute);
  EXPECT_DOUBLE_EQ(again.lr, 0.002);
  EXPECT_EQ(fsdp::train::given_flags_json(again).find("\"config\""), std::string::npos);
  const std::string log = temp_file("cli_log.jsonl", "");
  std::remove((dir + "cli_log.config.json").c_str());
  std::remove((dir + "cli_log.config-2.json").c_str());
  EXPECT_EQ(fsdp::train::write_given_flags(given, log), dir + "cli_log.config.json");
  EXPECT_EQ(fsdp::train::write_given_flags(given, log), dir + "cli_log.config-2.json");  // none replaced
  EXPECT_EQ(fsdp::train::write_given_flags(given, "/dev/null"), "");  // a log on a device: none
  // A resume says how its flags differ from those its checkpoint recorded (--resume aside).
  const std::string saved = fsdp::train::given_flags_json(checked({"--steps", "5", "--seq", "64", "--lr=0.003"}));
  EXPECT_EQ(fsdp::train::changed_flags(saved, checked({"--steps", "5", "--lr", "0.001", "--recompute"})),
            "--lr 0.001 (was 0.003), --recompute (new), --seq (dropped; was 64)");
  EXPECT_EQ(fsdp::train::changed_flags(saved, checked({"--lr=0.003", "--seq", "64", "--steps", "5"})), "");
  EXPECT_EQ(fsdp::train::changed_flags("not json", given), "");
}

// A flag in its topic's table, in a JSON or TOML config (torchtitan's format) and on the command
// line (--training.steps); a flag in another topic's table refused naming its own.
TEST(TrainArgs, ConfigTablesAreTheHelpsTopics) {
  using ::testing::HasSubstr;
  const TrainArgs json = checked({"--config", temp_file("tables.json", R"({"batch": 2, "training": {"steps": 9},
                                                                        "sharding": {"recompute": true}})")});
  EXPECT_EQ(json.batch, 2);
  EXPECT_EQ(json.steps, 9);
  EXPECT_TRUE(json.recompute);
  const TrainArgs line = checked({"--training.steps=11", "--model.seq", "24"});
  EXPECT_EQ(line.steps, 11);
  EXPECT_EQ(line.seq, 24);
  EXPECT_THAT(usage_error_of({"--model.steps=3"}), HasSubstr("--model.steps: --steps belongs in [training] (--training.steps)"));
  EXPECT_THAT(usage_error_of({"--config", temp_file("t1.json", R"({"model": {"steps": 3}})")}),
              HasSubstr("'model.steps': --steps belongs in [training]"));
  EXPECT_THAT(usage_error_of({"--config", temp_file("t2.json", R"({"steps": 3, "training": {"steps": 4}})")}),
              HasSubstr("gives 'steps' twice"));
  EXPECT_THAT(usage_error_of({"--config", temp_file("t3.json", R"({"training": {"x": {"steps": 4}}})")}),
              HasSubstr("nests too deep"));
  EXPECT_THAT(usage_error_of({"--config", temp_file("t4.json", R"({"training": {"steps": 3, "steps": 4}})")}),
              HasSubstr("gives 'steps' twice"));
  const std::string toml = temp_file("run.toml", R"(batch = 2
[model]
seq = 32
[training]
steps = 7
lr = 1e-3
[sharding]
recompute = true
cpu-offload = false
)");
  if (!fsdp::train::reads_toml()) {  // a build without toml++ names the package
    EXPECT_THAT(usage_error_of({"--config", toml}), HasSubstr("install libtomlplusplus-dev"));
    return;
  }
  const TrainArgs a = checked({"--config", toml, "--training.steps=8"});
  EXPECT_EQ(a.batch, 2);
  EXPECT_EQ(a.seq, 32);
  EXPECT_EQ(a.steps, 8);  // the command line's
  EXPECT_DOUBLE_EQ(a.lr, 1e-3);
  EXPECT_TRUE(a.recompute);
  EXPECT_FALSE(a.cpu_offload);
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"[model]\nsteps = 3\n", "'model.steps': --steps belongs in [training]"},
      {"steps = 3\n[training]\nsteps = 4\n", "gives 'steps' twice"},
      {"[training]\nsteps = 3\nsteps = 4\n", "line 3"},  // toml++ refuses a key redefined
      {"[training.x]\nsteps = 3\n", "nests too deep"},
      {"[sharding]\nrecompute = \"yes\"\n", "'sharding.recompute' is a switch: give true or false"},
      {"[training]\nsteps = [1]\n", "'training.steps' needs a string or a number"},
      {"[training]\nsteps = 2.5\n", "--steps (from --config"},
      {"steps = \n", "line 1"},
      {"bogus = 1\n", "unknown flag 'bogus'"},
  };
  for (const auto& [text, message] : refused)
    EXPECT_THAT(usage_error_of({"--config", temp_file("bad.toml", text)}), HasSubstr(message)) << text;
}

// --help shows each flag's default from the field itself, the runtime knobs' too.
TEST(TrainArgs, HelpShowsTheDefaultsOfTheFields) {
  using ::testing::HasSubstr;
  using ::testing::Not;
  const std::string help = fsdp::train::train_help_text();
  const TrainArgs defaults;
  for (const std::string line : {"--steps V", "--prefetch-depth V", "--max-inflight-allgathers V"}) {
    const size_t at = help.find(line);
    ASSERT_NE(at, std::string::npos) << line;
    const std::string text = help.substr(at, help.find('\n', at) - at);
    const int expected = line == "--steps V" ? defaults.steps
                         : line == "--prefetch-depth V" ? defaults.runtime.prefetch_depth
                                                        : defaults.runtime.max_inflight_allgathers;
    EXPECT_THAT(text, HasSubstr("(default " + std::to_string(expected) + ")")) << text;
  }
  EXPECT_THAT(help, Not(HasSubstr("--recompute V")));  // a switch takes no value and shows no default
  // Grouped by topic: each flag once, under its section (the planner's checks beside the budget, the
  // runtime's knobs with sharding, not among the basics), which names its --config table.
  const auto section_of = [&help](const std::string& flag) {
    const size_t at = help.find("\n  " + flag + " ");
    const size_t title = help.rfind("\n\n", at), end = help.find(":\n", title + 2);
    return at == std::string::npos || title == std::string::npos ? std::string() : help.substr(title + 2, end - title - 2);
  };
  EXPECT_EQ(section_of("--plan-check-steps"), "memory-budget planner ([planner])");
  EXPECT_EQ(section_of("--prefetch-depth"), "sharding, recomputation and scheduling ([sharding])");
  EXPECT_EQ(section_of("--keep-last"), "checkpoints and export ([checkpoint])");
  EXPECT_EQ(help.find("\n  --steps "), help.rfind("\n  --steps "));
}

// The 3b preset is Llama-3.2-3B, whose head is the embedding: 3.21B parameters, the flag's
// default (off) notwithstanding; --tie-embeddings ties the presets that do not tie.
TEST(TrainArgs, PresetTiesSurviveTheFlagsDefault) {
  const auto config = [](const std::vector<std::string>& argv) {
    return fsdp::train::model_config(fsdp::train::parse_train_args(argv));
  };
  EXPECT_TRUE(config({"--model", "3b"}).tie_embeddings);
  EXPECT_EQ(config({"--model", "3b"}).parameter_count(), 3212749824);  // Llama-3.2-3B's safetensors count
  EXPECT_FALSE(config({"--model", "1b"}).tie_embeddings);
  EXPECT_TRUE(config({"--model", "1b", "--tie-embeddings"}).tie_embeddings);
}

// The host-memory check's share for gradients waiting for the host's step: the largest group's or
// --max-pending-host-steps blocks' (at most every block), in the reduce dtype, over the shard ranks.
TEST(TrainArgs, HostGradientsWaitingForTheStepCountTheLargerOfRootAndPendingBlocks) {
  const auto bytes = [](const std::vector<std::string>& argv, int shard_ranks) {
    const TrainArgs a = fsdp::train::parse_train_args(argv);
    return fsdp::train::host_gradient_bytes(a, fsdp::train::model_config(a), shard_ranks);
  };
  const std::vector<std::string> offloaded = {"--cpu-offload", "--optimizer-in-backward", "--clip", "0"};
  const auto with = [&](std::vector<std::string> argv) {
    argv.insert(argv.end(), offloaded.begin(), offloaded.end());
    return argv;
  };
  // 8b: the root (2 x 128256 x 4096 embedding and head, 4096 norm) outweighs two blocks of 218,112,000.
  const double root_8b = 2.0 * 128256 * 4096 + 4096;
  EXPECT_EQ(bytes(with({"--model", "8b"}), 1), root_8b * 4);
  EXPECT_EQ(bytes(with({"--model", "8b", "--reduce-dtype", "bf16"}), 2), root_8b * 2 / 2);
  // small: 24 blocks of 2 x 512 + 4 x 512^2 + 3 x 512 x 1408 = 3,212,288 outweigh the root's 32.8M from 11 on.
  const double block_small = 3212288;
  EXPECT_EQ(bytes(with({"--model", "small", "--max-pending-host-steps", "20"}), 1), 20 * block_small * 4);
  EXPECT_EQ(bytes(with({"--model", "small", "--max-pending-host-steps", "99"}), 4), 24 * block_small);
  // Not offloaded, or stepped after backward: nothing waits.
  EXPECT_EQ(bytes({"--model", "8b", "--optimizer-in-backward", "--clip", "0"}, 1), 0);
  EXPECT_EQ(bytes({"--model", "8b", "--cpu-offload"}, 1), 0);
}

// Random command lines built from real flags, real and mangled values and junk: each is accepted
// or refused with a UsageError, never anything else. Seeded, so a failure repeats.
TEST(TrainArgs, FuzzedCommandLinesGetAUsageErrorOrAreAccepted) {
  TrainArgs defaults;
  const std::string text = ::testing::TempDir() + "fsdp_cli_fuzz.txt";
  std::ofstream(text) << std::string(300, 'x');
  const std::vector<std::string> names = {
      "--model", "--steps", "--batch", "--seq", "--lr", "--min-lr", "--warmup", "--weight-decay", "--clip",
      "--seed", "--data", "--param-dtype", "--reduce-dtype", "--backend", "--attention", "--fp8", "--log", "--timeout",
      "--prefetch-depth", "--max-inflight-allgathers", "--max-inflight-reduce-scatters", "--bucket-mb",
      "--reduce-bucket-max-wait", "--max-pending-host-steps", "--optimizer-in-backward",
      "--trace", "--trace-steps", "--profile", "--profile-steps", "--memory-snapshot", "--memory-log",
      "--save-init", "--memory-budget", "--plan-only", "--recompute", "--tie-embeddings",
      "--no-reshard-after-forward", "--dry-run",
      "--optimizer-before-shard", "--overwrite", "--overwrite-checkpoints", "--overwrite-export",
      "--allow-resume-changes", "--max-skipped-steps", "--save-dir", "--save-every", "--export",
      "--resume", "--init-from", "--config", "--log-every", "-", "--", "---steps", "--STEPS", "--steps=3", ""};
  const std::vector<std::string> values = {
      "0", "1", "2", "-1", "3.5", "1e308", "1e-320", "inf", "-inf", "nan", "0x10", "9223372036854775807",
      "18446744073709551616", "-9223372036854775809", "", " ", "1 2", "tiny", "small", "1b", "8b", "fp32",
      "bf16", "auto", "mpi", "nccl", "aten", "flash", "synthetic", "/", "/dev/null", "/dev/full", "/nonexistent/x",
      "/proc/self/status", text, std::string(5000, 'a'), std::string("\xff\xfe", 2), "--steps"};
  std::mt19937 rng(20261122);
  auto pick = [&rng](const std::vector<std::string>& from) { return from[rng() % from.size()]; };
  int accepted = 0, refused = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    std::vector<std::string> argv;
    const int words = static_cast<int>(rng() % 8);
    for (int w = 0; w < words; ++w) argv.push_back(rng() % 2 ? pick(names) : pick(values));
    try {
      checked(argv);
      ++accepted;
    } catch (const UsageError&) {
      ++refused;
    } catch (const std::exception& e) {
      std::string line;
      for (const auto& word : argv) line += "'" + word + "' ";
      ADD_FAILURE() << "not a usage error: " << e.what() << "\n  for: " << line;
    }
  }
  std::remove(text.c_str());
  EXPECT_GT(accepted, 100);  // the generator reaches valid command lines too
  EXPECT_GT(refused, 1000);
}

}  // namespace
