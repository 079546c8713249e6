// fsdp-run: starts N ranks of a program on this machine.
//   fsdp-run [-n N] [--cpu | --gpu] [--port P] PROGRAM [ARGS...]
// GPUs: N processes with the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT); if one fails the others are stopped. CPU: the
// MPI backend needs mpirun, so it runs `mpirun -n N PROGRAM ARGS`.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <dirent.h>
#include <string>
#include <vector>

namespace {

int visible_gpus() {
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) {
    std::string s = v;
    if (s.empty() || s == "-1") return 0;
    int n = 1;
    for (char c : s) n += c == ',';
    return n;
  }
  int n = 0;
  if (DIR* d = opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

bool port_is_free(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  int on = 1;  // the store binds with SO_REUSEADDR too, so a port in TIME_WAIT counts as free
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// A port below the kernel's ephemeral range: a port from inside it can be handed
// to an outgoing connection (even rank 1's own connect to the store, which then
// connects to itself) before rank 0 listens on it, and rank 0 fails with EADDRINUSE.
int free_port() {
  int ephemeral_low = 32768, ephemeral_high = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &ephemeral_low, &ephemeral_high) != 2) ephemeral_low = 32768;
    std::fclose(f);
  }
  // Below the range when there is room, else above it.
  int low = ephemeral_low > 2048 ? std::max(1024, ephemeral_low - 10000) : ephemeral_high + 1;
  int span = ephemeral_low > 2048 ? ephemeral_low - low : 65536 - low;
  std::srand(static_cast<unsigned>(getpid()) ^ static_cast<unsigned>(time(nullptr)));
  for (int attempt = 0; span > 0 && attempt < 200; ++attempt) {
    int port = low + std::rand() % span;
    if (port_is_free(port)) return port;
  }
  std::fprintf(stderr, "fsdp-run: no free port found outside the ephemeral range %d-%d; pass --port P\n",
               ephemeral_low, ephemeral_high);
  std::exit(1);
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "fsdp-run: %s\nusage: fsdp-run [-n N] [--cpu | --gpu] [--port P] PROGRAM [ARGS...]\n"
               "  -n N     ranks (default: one per visible GPU, or 2 without GPUs)\n"
               "  --cpu    CPU ranks through mpirun (default without GPUs)\n"
               "  --gpu    one process per GPU with torchrun-style variables\n"
               "  --port P rendezvous port on 127.0.0.1 (default: a free one)\n",
               why);
  std::exit(2);
}

[[noreturn]] void run_mpirun(int ranks, char** program_argv) {
  std::vector<std::string> args = {"mpirun", "-n", std::to_string(ranks), "--oversubscribe",
                                   "--bind-to", "none"};
  if (geteuid() == 0) args.push_back("--allow-run-as-root");
  // Containers often forbid the cross-memory-attach copy path; shared memory works everywhere.
  setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", /*overwrite=*/0);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  for (char** p = program_argv; *p; ++p) argv.push_back(*p);
  argv.push_back(nullptr);
  execvp("mpirun", argv.data());
  std::perror("fsdp-run: cannot start mpirun (install OpenMPI)");
  std::exit(127);
}

int run_gpu_ranks(int ranks, int port, char** program_argv) {
  std::vector<pid_t> children;
  for (int r = 0; r < ranks; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(ranks).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(ranks).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      execvp(program_argv[0], program_argv);
      std::fprintf(stderr, "fsdp-run: cannot run %s: %s\n", program_argv[0], std::strerror(errno));
      _exit(127);
    }
    children.push_back(pid);
  }
  int exit_code = 0, running = ranks;
  while (running > 0) {
    int status = 0;
    pid_t pid = wait(&status);
    if (pid < 0) break;
    --running;
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code != 0 && exit_code == 0) {
      exit_code = code;
      int rank = 0;
      while (children[rank] != pid) ++rank;
      std::fprintf(stderr, "fsdp-run: rank %d exited with status %d; stopping the others\n", rank, code);
      for (pid_t c : children)
        if (c != pid) kill(c, SIGTERM);
    }
  }
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 0, port = 0, i = 1;
  enum { Auto, Cpu, Gpu } mode = Auto;
  for (; i < argc && argv[i][0] == '-'; ++i) {
    std::string a = argv[i];
    if (a == "-n" && i + 1 < argc) ranks = std::atoi(argv[++i]);
    else if (a == "--port" && i + 1 < argc) port = std::atoi(argv[++i]);
    else if (a == "--cpu") mode = Cpu;
    else if (a == "--gpu") mode = Gpu;
    else if (a == "-h" || a == "--help") usage("runs PROGRAM as N ranks");
    else usage(("unknown option " + a).c_str());
  }
  if (i >= argc) usage("no PROGRAM given");
  const int gpus = visible_gpus();
  if (mode == Auto) mode = gpus > 0 ? Gpu : Cpu;
  if (ranks == 0) ranks = mode == Gpu ? gpus : 2;
  if (ranks < 1) usage("-n must be at least 1");
  if (mode == Gpu && ranks > gpus)
    usage(("asked for " + std::to_string(ranks) + " GPU ranks but " + std::to_string(gpus) +
           " GPU(s) are visible").c_str());
  if (mode == Cpu) run_mpirun(ranks, argv + i);
  return run_gpu_ranks(ranks, port ? port : free_port(), argv + i);
}
