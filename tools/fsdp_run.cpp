// fsdp-run: starts N ranks of a program on this machine.
//   fsdp-run [-n N] [--cpu | --gpu] [--port P] [--grace S] PROGRAM [ARGS...]
// GPUs: N processes with the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT); if one fails the others are stopped. CPU: the
// MPI backend needs mpirun, so it runs `mpirun -q -n N PROGRAM ARGS`.
// SIGINT, SIGTERM and SIGHUP (as SIGTERM) reach every rank (on CPU as SIGUSR1 to mpirun's
// children); a second signal ends them at once, and ranks still running --grace seconds
// (default 60: time to save a checkpoint) later are killed; fsdp-run then exits with the code
// every rank exited with where they agree (0: stopped cleanly; fsdp-train's 3: stopped with its
// state saved, to be resumed), else 128 + the signal (130, 143).
// A rank's exit code 2 (a usage error) or 3 (a resumable stop), which the program has reported,
// is passed on without a message. A PROGRAM that cannot be started is one line and
// exit code 127, as in shells; a rank killed by a signal is one line naming the
// rank and the signal (on CPU each rank runs under `fsdp-run --mpi-rank`, which
// waits for it and says so; mpirun itself stays quiet, -q). mpirun killed by a
// signal fsdp-run did not send is named too, and the ranks it leaves are killed.
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
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

const char* kUsage =
    "usage: fsdp-run [-n N] [--cpu | --gpu] [--port P] [--grace S] PROGRAM [ARGS...]\n"
    "  -n N     ranks (default: one per visible GPU, or 2 without GPUs)\n"
    "  --cpu    CPU ranks through mpirun, GPUs hidden (default without GPUs)\n"
    "  --gpu    one process per GPU with torchrun-style variables\n"
    "  --port P rendezvous port on 127.0.0.1 (default: a free one)\n"
    "  --grace S after SIGINT/SIGTERM, kill ranks still running S seconds later (default 60)\n"
    "  --version fsdp.cpp's version\n"
    "SIGINT/SIGTERM/SIGHUP reach every rank (CPU ranks as SIGUSR1); a second one\n"
    "ends them at once. Exit code after a signal: the ranks' own where they agree\n"
    "(0, or fsdp-train's 3: stopped and saved, resume it), else 128 + the signal.\n";

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "fsdp-run: %s (see fsdp-run --help)\n", why);
  std::exit(2);
}

volatile sig_atomic_t g_signal = 0;    // the first SIGINT/SIGTERM received
volatile sig_atomic_t g_signals = 0;   // how many
bool g_through_mpirun = false;         // CPU: the one child is mpirun, the ranks are its children
int g_grace_s = 60;                    // after the first signal, SIGKILL what still runs

// A rank's exit codes that the program has explained itself: fsdp-run passes them on silently.
bool reported_by_the_program(int code) {
  return code == 2 || code == 3;  // a usage error; fsdp-train's stop with its state saved (resumable)
}

void note_signal(int sig) {  // the wait loop does the work: nothing here but flags
  // A hangup (the terminal or ssh session gone) asks the ranks to save and stop, as SIGTERM does.
  if (!g_signal) g_signal = sig == SIGHUP ? SIGTERM : sig;
  ++g_signals;
}

void install_signal_handlers() {
  struct sigaction action{};
  action.sa_handler = note_signal;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &action, nullptr);
}

// Every process below `root` (its children, theirs, ...), from /proc.
std::vector<pid_t> descendants(pid_t root) {
  std::vector<std::pair<pid_t, pid_t>> parent_of;  // (pid, ppid)
  if (DIR* d = opendir("/proc")) {
    while (dirent* e = readdir(d)) {
      const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));
      if (pid <= 0) continue;
      FILE* f = std::fopen(("/proc/" + std::string(e->d_name) + "/stat").c_str(), "r");
      if (!f) continue;
      char line[1024] = {0};
      const size_t n = std::fread(line, 1, sizeof(line) - 1, f);
      std::fclose(f);
      const char* close = std::strrchr(line, ')');  // the command may hold spaces and parentheses
      int ppid = 0;
      if (n > 0 && close && std::sscanf(close + 1, " %*c %d", &ppid) == 1) parent_of.emplace_back(pid, ppid);
    }
    closedir(d);
  }
  std::vector<pid_t> found = {root};
  for (size_t i = 0; i < found.size(); ++i)
    for (const auto& [pid, ppid] : parent_of)
      if (ppid == found[i]) found.push_back(pid);
  found.erase(found.begin());
  return found;
}

// The first signal asks the ranks to stop: directly on GPUs; on CPU as SIGUSR1 to mpirun's
// children, because mpirun ends the job at once on SIGTERM/SIGINT (and not every Open MPI passes
// SIGUSR1 on). A second signal ends them: SIGTERM to mpirun, SIGKILL to GPU ranks.
void forward(const std::vector<pid_t>& children, int nth) {
  if (!g_through_mpirun) {
    for (pid_t c : children) kill(c, nth == 1 ? g_signal : SIGKILL);
  } else if (nth == 1) {
    for (pid_t rank : descendants(children.front())) kill(rank, SIGUSR1);
  } else {
    kill(children.front(), SIGTERM);
  }
}

void kill_all(const std::vector<pid_t>& children) {
  for (pid_t c : children) {
    for (pid_t below : descendants(c)) kill(below, SIGKILL);
    kill(c, SIGKILL);
  }
}

pid_t start(char** argv) {
  pid_t pid = fork();
  if (pid == 0) {
    execvp(argv[0], argv);
    std::fprintf(stderr, "fsdp-run: cannot run %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  if (pid < 0) {
    std::perror("fsdp-run: fork");
    std::exit(1);
  }
  return pid;
}

// Waits for every child. The first to fail stops the others (`describe` names it); signals are
// forwarded, and whatever still runs --grace seconds after the first is killed, the ranks
// below mpirun included. Returns the exit code for fsdp-run.
int wait_for_children(const std::vector<pid_t>& children, const char* (*describe)(size_t index)) {
  int exit_code = 0;
  size_t running = children.size();
  std::chrono::steady_clock::time_point kill_at{};  // set once a signal came
  bool killed = false;
  int common_code = -1;  // the exit code every child exited with, while they agree (-2 once they differ)
  int forwarded = 0;
  while (running > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno != EINTR) break;
    if (pid > 0 && std::find(children.begin(), children.end(), pid) == children.end()) continue;  // an orphan reaped
    for (const int received = g_signals; forwarded < std::min(received, 2); ++forwarded) forward(children, forwarded + 1);
    if (pid <= 0) {
      const auto now = std::chrono::steady_clock::now();
      if (g_signal && kill_at == std::chrono::steady_clock::time_point{}) kill_at = now + std::chrono::seconds(g_grace_s);
      if (g_signal && !killed && now > kill_at) {
        kill_all(children);
        killed = true;
      }
      usleep(20000);
      continue;
    }
    --running;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    common_code = common_code == -1 || common_code == code ? code : -2;
    if (g_through_mpirun && !WIFEXITED(status) && !g_signal) {
      // mpirun killed by someone else: its ranks, now fsdp-run's (a subreaper), would run on unseen.
      std::fprintf(stderr, "fsdp-run: mpirun (pid %d) was killed by signal %d (%s); stopping the ranks it left\n",
                   static_cast<int>(pid), WTERMSIG(status), strsignal(WTERMSIG(status)));
      for (pid_t below : descendants(getpid())) kill(below, SIGKILL);
    }
    if (code == 0 || exit_code != 0 || g_signal) continue;
    exit_code = code;
    const size_t index = std::find(children.begin(), children.end(), pid) - children.begin();
    if (!reported_by_the_program(code) && describe)
      std::fprintf(stderr, "fsdp-run: %s exited with status %d; stopping the others\n", describe(index), code);
    for (pid_t c : children)
      if (c != pid) kill(c, SIGTERM);
  }
  if (g_signal) {
    // Ranks that handled the signal and stopped as the program does (0 cleanly, fsdp-train's 3
    // after saving) agree on their exit code: it is fsdp-run's.
    const bool agreed = common_code >= 0 && common_code < 128;
    std::fprintf(stderr, "fsdp-run: %s; every rank has exited%s\n", g_signal == SIGINT ? "interrupted" : "terminated",
                 agreed ? (common_code == 0 ? " cleanly" : (" with status " + std::to_string(common_code)).c_str()) : "");
    return agreed ? common_code : 128 + g_signal;
  }
  return exit_code;
}

// Whether execvp would find `program`: a path with a slash as it is, else a name on PATH.
bool can_execute(const std::string& program) {
  auto executable = [](const std::string& path) {
    struct stat st{};
    return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) return executable(program);
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  for (size_t begin = 0; begin <= dirs.size();) {
    size_t end = dirs.find(':', begin);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = end > begin ? dirs.substr(begin, end - begin) : ".";
    if (executable(dir + "/" + program)) return true;
    begin = end + 1;
  }
  return false;
}

// fsdp-run --mpi-rank PROGRAM ARGS: what mpirun starts for each CPU rank. Runs PROGRAM as its
// child and exits as it did; if it was killed by a signal nobody asked for, says which rank died
// of which signal (mpirun -q would say nothing). A signal to this process (mpirun ending the job)
// is passed on to PROGRAM and not reported; SIGUSR1 is not passed on, since fsdp-run sends it to
// every process below mpirun already. PROGRAM dies with this process (PR_SET_PDEATHSIG).
volatile sig_atomic_t g_rank_child = 0;
volatile sig_atomic_t g_rank_signalled = 0;

void pass_on(int sig) {
  g_rank_signalled = 1;
  if (g_rank_child > 0) kill(g_rank_child, sig);
}

int run_as_mpi_rank(char** program_argv) {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const pid_t self = getpid();
  const pid_t child = fork();
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != self) _exit(128 + SIGKILL);  // the wrapper died before the line above
    execvp(program_argv[0], program_argv);
    std::fprintf(stderr, "fsdp-run: rank %s: cannot run %s: %s\n", rank ? rank : "?", program_argv[0],
                 std::strerror(errno));
    _exit(127);
  }
  if (child < 0) {
    std::perror("fsdp-run: fork");
    return 1;
  }
  g_rank_child = child;
  struct sigaction action{};
  action.sa_handler = pass_on;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT}) sigaction(sig, &action, nullptr);
  signal(SIGUSR1, SIG_IGN);
  int status = 0;
  while (waitpid(child, &status, 0) < 0)
    if (errno != EINTR) return 1;
  if (WIFEXITED(status)) {
    // mpirun -q says nothing of a rank's non-zero exit: this line does (2, a usage error, the
    // program has reported; an exit while mpirun ends the job is its consequence, not news).
    const int code = WEXITSTATUS(status);
    if (code != 0 && !reported_by_the_program(code) && !g_rank_signalled)
      std::fprintf(stderr, "fsdp-run: rank %s (pid %d) exited with status %d\n", rank ? rank : "?",
                   static_cast<int>(child), code);
    return code;
  }
  const int sig = WTERMSIG(status);
  // SIGUSR1 is fsdp-run's stop request (SIGTERM or SIGINT passed on): a program that ends of it
  // before it handles it (in its start-up) stopped as asked, and fsdp-run says so.
  if (!g_rank_signalled && sig != SIGUSR1)
    std::fprintf(stderr, "fsdp-run: rank %s (pid %d) was killed by signal %d (%s)\n", rank ? rank : "?",
                 static_cast<int>(child), sig, strsignal(sig));
  return 128 + sig;
}

int run_mpirun(int ranks, char** program_argv) {
  // -q: no Open MPI notes after a rank's own error message (MPI_Abort, non-zero exits); each rank
  // runs under `fsdp-run --mpi-rank`, which reports a rank killed by a signal in one line.
  std::vector<std::string> args = {"mpirun", "-q", "-n", std::to_string(ranks), "--oversubscribe",
                                   "--bind-to", "none"};
  if (geteuid() == 0) args.push_back("--allow-run-as-root");
  // Containers often forbid the cross-memory-attach copy path; shared memory works everywhere.
  setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", /*overwrite=*/0);
  std::vector<char*> argv;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {  // else the ranks run bare: a death by signal is then not named
    self[n] = '\0';
    args.push_back(self);
    args.push_back("--mpi-rank");
  }
  for (auto& a : args) argv.push_back(a.data());
  for (char** p = program_argv; *p; ++p) argv.push_back(*p);
  argv.push_back(nullptr);
  install_signal_handlers();
  g_through_mpirun = true;
  // The ranks' wrappers are reparented to fsdp-run, not init, if mpirun dies: they stay in reach.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  const int code = wait_for_children({start(argv.data())}, nullptr);  // mpirun names the failed rank itself
  if (code == 127 && !g_signal) std::fprintf(stderr, "fsdp-run: cannot start mpirun (install OpenMPI)\n");
  return code;
}

int run_gpu_ranks(int ranks, int port, char** program_argv) {
  install_signal_handlers();
  std::vector<pid_t> children;
  for (int r = 0; r < ranks; ++r) {
    setenv("RANK", std::to_string(r).c_str(), 1);
    setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
    setenv("WORLD_SIZE", std::to_string(ranks).c_str(), 1);
    setenv("LOCAL_WORLD_SIZE", std::to_string(ranks).c_str(), 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    children.push_back(start(program_argv));
  }
  return wait_for_children(children, [](size_t rank) {
    static std::string name;
    name = "rank " + std::to_string(rank);
    return name.c_str();
  });
}

// A whole decimal number in [low, high], or -1.
int integer_in(const char* text, int low, int high) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  return errno == 0 && end != text && *end == '\0' && v >= low && v <= high ? static_cast<int>(v) : -1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::strcmp(argv[1], "--mpi-rank") == 0) return run_as_mpi_rank(argv + 2);
  int ranks = 0, port = 0, i = 1;
  enum { Auto, Cpu, Gpu } mode = Auto;
  for (; i < argc && argv[i][0] == '-'; ++i) {
    std::string a = argv[i];
    if (a == "-n" || a == "--port" || a == "--grace") {
      if (i + 1 >= argc) usage((a + " needs a value").c_str());
      if (a == "-n" && (ranks = integer_in(argv[++i], 1, 4096)) < 0) usage("-n must be a whole number of ranks, at least 1");
      if (a == "--port" && (port = integer_in(argv[++i], 1, 65535)) < 0) usage("--port must be a TCP port (1-65535)");
      if (a == "--grace" && (g_grace_s = integer_in(argv[++i], 0, 86400)) < 0) usage("--grace must be 0 to 86400 seconds");
    }
    else if (a == "--cpu") mode = Cpu;
    else if (a == "--gpu") mode = Gpu;
    else if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    else if (a == "--version") {
      std::printf("fsdp-run %s\n", FSDP_VERSION_STRING);
      return 0;
    }
    else usage(("unknown option " + a).c_str());
  }
  if (i >= argc) usage("no PROGRAM given");
  if (!can_execute(argv[i])) {
    std::fprintf(stderr, "fsdp-run: cannot run %s: %s\n", argv[i],
                 std::strchr(argv[i], '/') ? "no such executable file" : "not found on PATH");
    return 127;
  }
  // The ranks write to pipes that reach this terminal: a program that shows a progress line on a
  // terminal alone (fsdp-train's saves, loads and exports) learns that it may.
  if (isatty(STDOUT_FILENO)) setenv("FSDP_STDOUT_IS_TERMINAL", "1", 1);
  const int gpus = visible_gpus();
  if (mode == Auto) mode = gpus > 0 ? Gpu : Cpu;
  if (ranks == 0) ranks = mode == Gpu ? gpus : 2;
  if (ranks == 0) usage("no GPU ranks to start: no GPU is visible (use --cpu)");
  if (mode == Gpu && ranks > gpus)
    usage(("asked for " + std::to_string(ranks) + " GPU ranks but " + std::to_string(gpus) +
           " GPU(s) are visible").c_str());
  if (mode == Cpu) {
    // CPU ranks even where GPUs exist: a program choosing its backend by what it sees picks MPI.
    setenv("CUDA_VISIBLE_DEVICES", "", 1);
    return run_mpirun(ranks, argv + i);
  }
  return run_gpu_ranks(ranks, port ? port : free_port(), argv + i);
}
