#include "train/lineage.h"

#include <algorithm>
#include <cstdlib>
#include <ctime>

#include "fsdp/sharded_checkpoint.h"
#include "io/files.h"

namespace fsdp::train {

std::vector<SavedCheckpoint> saved_checkpoints(const std::string& dir) {
  std::vector<SavedCheckpoint> found;
  for (const auto& name : io::list_directory(dir)) {
    const int64_t step = checkpoint_step(name);
    if (step < 0) continue;
    const std::string path = dir + "/" + name;
    if (!io::exists(path + "/metadata.bin")) continue;  // an interrupted save
    std::string run;
    try {
      run = run_of(checkpoint_extra(path));
    } catch (const std::exception&) {  // damaged metadata: a checkpoint of no known run
    }
    found.push_back({path, static_cast<int>(step), run});
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return found;
}

std::string run_of(const std::map<std::string, std::string>& extra) {
  const auto it = extra.find("run");
  return it == extra.end() ? std::string() : it->second;
}

std::vector<SavedCheckpoint> other_runs(const std::vector<SavedCheckpoint>& saved, const std::string& run) {
  std::vector<SavedCheckpoint> others;
  for (const auto& c : saved)
    if (run.empty() || c.run != run) others.push_back(c);
  return others;
}

std::vector<SavedCheckpoint> older_than_newest(const std::vector<SavedCheckpoint>& saved, const std::string& run,
                                               int keep) {
  std::vector<SavedCheckpoint> own;
  for (const auto& c : saved)
    if (!run.empty() && c.run == run) own.push_back(c);
  own.resize(own.size() > static_cast<size_t>(keep) ? own.size() - keep : 0);
  return own;
}

std::string set_aside_abandoned_branch(const std::string& dir, const std::string& run, int step) {
  std::vector<SavedCheckpoint> branch;
  for (const auto& c : saved_checkpoints(dir))
    if (c.run == run && c.step > step) branch.push_back(c);
  if (branch.empty()) return "";
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &local);
  const std::string aside = dir + "/abandoned-after-" + checkpoint_name(step) + "-" + stamp;
  io::make_directories(aside);
  for (const auto& c : branch) io::rename_path(c.path, aside + "/" + checkpoint_name(c.step));
  io::sync_directory(dir);
  return aside;
}

}  // namespace fsdp::train
