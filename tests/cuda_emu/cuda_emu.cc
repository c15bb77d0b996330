// CPU emulator of the CUDA runtime, the kernel execution model and a cuBLAS subset. See
// cuda_emu.h for what it checks and what it cannot.
#include "cuda_emu.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

// Fibers switch with a few instructions of x86-64 assembly; elsewhere (or with
// -DKVFLOW_EMU_USE_UCONTEXT) with swapcontext, which is slower (a sigprocmask per switch).
#if defined(__x86_64__) && !defined(KVFLOW_EMU_USE_UCONTEXT)
#define KVFLOW_EMU_ASM_SWITCH 1
#else
#define KVFLOW_EMU_ASM_SWITCH 0
#include <ucontext.h>
#endif

// The runtime's opaque handle types, defined here: the emulator owns them.
struct CUstream_st {
  unsigned flags = 0;
  int priority = 0;
  struct Capture* capture = nullptr;  // the capture this stream records into (origin or joined)
};
struct CUevent_st {
  unsigned flags = 0;
  bool recorded = false;
  std::chrono::steady_clock::time_point time;
  struct Capture* recorded_in_capture = nullptr;
};
struct CUgraph_st {
  std::vector<std::function<void()>> nodes;
};
struct CUgraphExec_st {
  std::vector<std::function<void()>> nodes;
};
struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasMath_t math_mode = CUBLAS_DEFAULT_MATH;
  cublasPointerMode_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
};

struct Capture {
  cudaStream_t origin = nullptr;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;
  bool invalidated = false;
  std::vector<std::function<void()>> nodes;
  std::vector<cudaStream_t> joined;  // streams (besides origin) that joined via cudaStreamWaitEvent
};

namespace kvflow_emu {
namespace internal {

ThreadIds* g_thread = nullptr;
BlockState g_block{};

}  // namespace internal

namespace {

using internal::Collective;
using internal::g_block;
using internal::g_thread;
using internal::LaneSlot;
using internal::ThreadIds;

// ---- global state --------------------------------------------------------------------------------------

// Guards all runtime state. Recursive: graph replay and cuBLAS run kernels/copies from inside API
// calls. Kernels run while it is held, which serializes launches from several host threads.
std::recursive_mutex g_mu;
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local cudaStreamCaptureMode t_capture_mode = cudaStreamCaptureModeGlobal;

Stats g_stats;

cudaError_t SetError(cudaError_t e) {
  if (e != cudaSuccess) t_last_error = e;
  return e;
}

void Warn(const char* format, ...) __attribute__((format(printf, 1, 2)));
void Warn(const char* format, ...) {
  if (std::getenv("KVFLOW_EMU_QUIET")) return;
  std::va_list args;
  va_start(args, format);
  std::fprintf(stderr, "kvflow CUDA emulator: ");
  std::vfprintf(stderr, format, args);
  std::fprintf(stderr, "\n");
  va_end(args);
}

size_t EnvBytes(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  double scale = 1;
  if (end && (*end == 'k' || *end == 'K')) scale = 1024.0;
  if (end && (*end == 'm' || *end == 'M')) scale = 1024.0 * 1024;
  if (end && (*end == 'g' || *end == 'G')) scale = 1024.0 * 1024 * 1024;
  return x > 0 ? static_cast<size_t>(x * scale) : fallback;
}

// ---- kernel names for messages ------------------------------------------------------------------------

// Looks `address` up in the ELF symbol table (.symtab, which dladdr does not read: kernels are
// usually in anonymous namespaces) of the object that contains it.
std::string SymbolName(const void* address) {
  Dl_info info{};
  if (!dladdr(address, &info) || !info.dli_fname) return {};
  std::string name;
  if (info.dli_sname && info.dli_saddr == address) name = info.dli_sname;
  if (name.empty()) {
    const char* path = info.dli_fname;
    if (!*path) path = "/proc/self/exe";
    const int fd = open(path, O_RDONLY);
    if (fd < 0) return {};
    struct stat st {};
    if (fstat(fd, &st) == 0 && st.st_size > static_cast<off_t>(sizeof(Elf64_Ehdr))) {
      void* map = mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (map != MAP_FAILED) {
        const auto* base = static_cast<const unsigned char*>(map);
        const auto* ehdr = reinterpret_cast<const Elf64_Ehdr*>(base);
        if (std::memcmp(ehdr->e_ident, ELFMAG, SELFMAG) == 0 && ehdr->e_ident[EI_CLASS] == ELFCLASS64 &&
            ehdr->e_shoff + ehdr->e_shnum * sizeof(Elf64_Shdr) <= static_cast<size_t>(st.st_size)) {
          const uintptr_t target = reinterpret_cast<uintptr_t>(address) -
                                   (ehdr->e_type == ET_DYN ? reinterpret_cast<uintptr_t>(info.dli_fbase) : 0);
          const auto* sections = reinterpret_cast<const Elf64_Shdr*>(base + ehdr->e_shoff);
          for (int s = 0; s < ehdr->e_shnum && name.empty(); ++s) {
            if (sections[s].sh_type != SHT_SYMTAB) continue;
            const Elf64_Shdr& strtab = sections[sections[s].sh_link];
            const auto* syms = reinterpret_cast<const Elf64_Sym*>(base + sections[s].sh_offset);
            const size_t count = sections[s].sh_size / sizeof(Elf64_Sym);
            for (size_t i = 0; i < count; ++i) {
              if (ELF64_ST_TYPE(syms[i].st_info) != STT_FUNC) continue;
              if (target >= syms[i].st_value && target < syms[i].st_value + std::max<uint64_t>(syms[i].st_size, 1)) {
                name = reinterpret_cast<const char*>(base + strtab.sh_offset + syms[i].st_name);
                break;
              }
            }
          }
        }
        munmap(map, st.st_size);
      }
    }
    close(fd);
  }
  if (name.empty()) return {};
  int status = 0;
  char* demangled = abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status);
  if (status == 0 && demangled) {
    name = demangled;
    std::free(demangled);
  }
  return name;
}

// ---- fibers ----------------------------------------------------------------------------------------------

#if KVFLOW_EMU_ASM_SWITCH
extern "C" void kvflow_emu_switch_context(void** save_sp, void* load_sp);
extern "C" void kvflow_emu_fiber_trampoline();
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save_sp,
// switches to load_sp and restores the registers saved there. A new fiber's stack is prepared so
// that the final `ret` enters the trampoline with the fiber in r12.
asm(R"(
  .text
  .p2align 4
  .globl kvflow_emu_switch_context
  .hidden kvflow_emu_switch_context
  .type kvflow_emu_switch_context,@function
kvflow_emu_switch_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kvflow_emu_switch_context, .-kvflow_emu_switch_context

  .p2align 4
  .globl kvflow_emu_fiber_trampoline
  .hidden kvflow_emu_fiber_trampoline
  .type kvflow_emu_fiber_trampoline,@function
kvflow_emu_fiber_trampoline:
  movq %r12, %rdi
  call kvflow_emu_fiber_main
  ud2
  .size kvflow_emu_fiber_trampoline, .-kvflow_emu_fiber_trampoline
)");
#endif

enum class FiberState : uint8_t { kReady, kBarrier, kWarp, kDone };

struct Fiber {
  ThreadIds ids;  // g_thread points here while the fiber runs
  void* sp = nullptr;
#if !KVFLOW_EMU_ASM_SWITCH
  ucontext_t context;
#endif
  char* stack_low = nullptr;  // usable stack [stack_low, stack_low + stack_bytes)
  int index = 0;
  FiberState state = FiberState::kReady;
  Collective waiting_op = Collective::kSyncWarp;
  uint32_t collective_seq = 0;  // warp collectives this lane has entered
};

struct Warp {
  LaneSlot slots[2][32];
  int arrived[2] = {0, 0};
  Collective op[2] = {};
  size_t size[2] = {0, 0};
  int lanes = 0;
  int exited = 0;
  unsigned lane_mask = 0;  // lanes that exist
};

struct KernelLaunch {
  const void* kernel = nullptr;
  const char* signature = "";
  dim3 grid, block;
  size_t dynamic_smem = 0;
  std::function<void()> body;
};

// Everything about the kernel being run. Only one at a time (g_mu).
struct Executor {
  size_t stack_bytes = 0;
  size_t guard_bytes = 0;
  char* stack_region = nullptr;
  size_t stack_region_bytes = 0;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<unsigned char> smem_storage;
  Fiber* current = nullptr;
  void* main_sp = nullptr;
#if !KVFLOW_EMU_ASM_SWITCH
  ucontext_t main_context;
#endif
  int num_threads = 0;
  int live = 0;
  bool reverse = false;  // this block runs its threads in descending order
  // __syncthreads
  int barrier_arrived = 0;
  int barrier_count = 0;         // predicates counted so far in the open barrier
  int barrier_result_count = 0;  // of the last completed barrier
  int barrier_result_threads = 0;
  const KernelLaunch* launch = nullptr;
  bool in_kernel = false;
  std::string kernel_name;  // resolved lazily for messages
};
Executor g_exec;

const char* KernelName() {
  if (!g_exec.launch) return "(no kernel)";
  if (g_exec.kernel_name.empty()) {
    g_exec.kernel_name = SymbolName(g_exec.launch->kernel);
    if (g_exec.kernel_name.empty()) g_exec.kernel_name = std::string("kernel launched by ") + g_exec.launch->signature;
  }
  return g_exec.kernel_name.c_str();
}

const char* CollectiveName(Collective op) {
  switch (op) {
    case Collective::kSyncWarp: return "__syncwarp";
    case Collective::kShfl: return "__shfl_sync";
    case Collective::kShflUp: return "__shfl_up_sync";
    case Collective::kShflDown: return "__shfl_down_sync";
    case Collective::kShflXor: return "__shfl_xor_sync";
    case Collective::kBallot: return "__ballot_sync";
    case Collective::kAny: return "__any_sync";
    case Collective::kAll: return "__all_sync";
    case Collective::kReduce: return "__reduce_*_sync";
    case Collective::kMatchAny: return "__match_any_sync";
    case Collective::kMatchAll: return "__match_all_sync";
    case Collective::kMma: return "mma.sync (MmaM16N8K16)";
    case Collective::kLdMatrix: return "ldmatrix (LdMatrix*)";
  }
  return "?";
}

void EnsureStacks(int threads) {
  if (static_cast<int>(g_exec.fibers.size()) >= threads && g_exec.stack_region) return;
  if (g_exec.stack_bytes == 0) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    g_exec.stack_bytes = (EnvBytes("KVFLOW_EMU_STACK_KB", 0) ? EnvBytes("KVFLOW_EMU_STACK_KB", 0) * 1024 : 256 * 1024);
    g_exec.stack_bytes = (g_exec.stack_bytes + page - 1) / page * page;
    g_exec.guard_bytes = page;
  }
  if (g_exec.stack_region) munmap(g_exec.stack_region, g_exec.stack_region_bytes);
  const int count = std::max(threads, 256);
  const size_t per = g_exec.stack_bytes + g_exec.guard_bytes;
  g_exec.stack_region_bytes = per * count;
  void* region = mmap(nullptr, g_exec.stack_region_bytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (region == MAP_FAILED) {
    std::fprintf(stderr, "kvflow CUDA emulator: cannot map %zu bytes of fiber stacks\n", g_exec.stack_region_bytes);
    std::abort();
  }
  g_exec.stack_region = static_cast<char*>(region);
  g_exec.fibers.assign(count, Fiber{});
  for (int i = 0; i < count; ++i) {
    char* low = g_exec.stack_region + i * per;
    mprotect(low, g_exec.guard_bytes, PROT_NONE);  // overflow faults instead of corrupting a neighbour
    g_exec.fibers[i].stack_low = low + g_exec.guard_bytes;
    g_exec.fibers[i].index = i;
  }
}

// SIGSEGV below the running fiber's stack (its guard page, or further down when a large frame
// skipped the guard): a stack overflow. Says so, then lets the default action run.
void OnSegv(int sig, siginfo_t* info, void*) {
  const char* addr = static_cast<const char*>(info->si_addr);
  const Fiber* f = g_exec.current;
  if (g_exec.in_kernel && f && addr < f->stack_low && addr + (size_t{256} << 20) >= f->stack_low) {
    static const char msg[] =
        "kvflow CUDA emulator: STACK OVERFLOW in an emulated GPU thread (local arrays too large?); raise "
        "KVFLOW_EMU_STACK_KB (default 256)\n";
    (void)!write(2, msg, sizeof(msg) - 1);
  }
  signal(sig, SIG_DFL);
}

void InstallStackOverflowHandler() {
  thread_local bool installed = false;
  if (installed) return;
  installed = true;
  static thread_local std::vector<char> alt_stack(64 * 1024);
  stack_t ss{};
  ss.ss_sp = alt_stack.data();
  ss.ss_size = alt_stack.size();
  sigaltstack(&ss, nullptr);
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    struct sigaction old {};
    sigaction(SIGSEGV, nullptr, &old);
    if (old.sa_handler != SIG_DFL) return;  // someone else handles it (a sanitizer, a debugger helper)
    sa.sa_sigaction = OnSegv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, nullptr);
  });
}

[[noreturn]] void FiberExit(Fiber* me);

void CheckGuardsAfterKernel();

}  // namespace
}  // namespace kvflow_emu

extern "C" __attribute__((visibility("hidden"), noreturn, used)) void kvflow_emu_fiber_main(void* fiber) {
  kvflow_emu::g_exec.launch->body();
  kvflow_emu::FiberExit(static_cast<kvflow_emu::Fiber*>(fiber));
}

#if !KVFLOW_EMU_ASM_SWITCH
static void kvflow_emu_ucontext_entry(unsigned lo, unsigned hi) {
  kvflow_emu_fiber_main(reinterpret_cast<void*>((static_cast<uintptr_t>(hi) << 32) | lo));
}
#endif

namespace kvflow_emu {
namespace {

// Where a fiber's stack starts (16-byte aligned, as the ABI wants).
uintptr_t StackTop(const Fiber& f) {
  return (reinterpret_cast<uintptr_t>(f.stack_low) + g_exec.stack_bytes) & ~static_cast<uintptr_t>(15);
}

void PrepareFiber(Fiber& f) {
#if KVFLOW_EMU_ASM_SWITCH
  auto* top = reinterpret_cast<uintptr_t*>(StackTop(f));
  top[-1] = reinterpret_cast<uintptr_t>(&kvflow_emu_fiber_trampoline);  // `ret` target
  top[-2] = 0;                                                           // rbp
  top[-3] = 0;                                                           // rbx
  top[-4] = reinterpret_cast<uintptr_t>(&f);                             // r12
  top[-5] = 0;                                                           // r13
  top[-6] = 0;                                                           // r14
  top[-7] = 0;                                                           // r15
  f.sp = top - 7;
#else
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack_low;
  f.context.uc_stack.ss_size = StackTop(f) - reinterpret_cast<uintptr_t>(f.stack_low);
  f.context.uc_link = nullptr;
  const uintptr_t p = reinterpret_cast<uintptr_t>(&f);
  makecontext(&f.context, reinterpret_cast<void (*)()>(kvflow_emu_ucontext_entry), 2,
              static_cast<unsigned>(p & 0xffffffffu), static_cast<unsigned>(p >> 32));
#endif
}

inline void SwitchTo(void** save_sp, Fiber* from, Fiber* to) {
  ++g_stats.context_switches;
#if KVFLOW_EMU_ASM_SWITCH
  (void)from;
  kvflow_emu_switch_context(save_sp, to ? to->sp : g_exec.main_sp);
#else
  (void)save_sp;
  swapcontext(from ? &from->context : &g_exec.main_context, to ? &to->context : &g_exec.main_context);
#endif
}

// The current fiber cannot go on (blocked or done): runs the next ready fiber in round-robin order,
// or returns to the scheduler when there is none (all done, or a deadlock). Returns when the
// current fiber is resumed.
void Reschedule() {
  Fiber* me = g_exec.current;
  const int n = g_exec.num_threads;
  Fiber* next = nullptr;
  if (!g_exec.reverse) {
    for (int step = 1; step <= n; ++step) {
      int i = me->index + step;
      if (i >= n) i -= n;
      if (g_exec.fibers[i].state == FiberState::kReady) {
        next = &g_exec.fibers[i];
        break;
      }
    }
  } else {
    for (int step = 1; step <= n; ++step) {
      int i = me->index - step;
      if (i < 0) i += n;
      if (g_exec.fibers[i].state == FiberState::kReady) {
        next = &g_exec.fibers[i];
        break;
      }
    }
  }
  if (next == me) return;
  if (next) {
    g_exec.current = next;
    g_thread = &next->ids;
  } else {
    g_exec.current = nullptr;
    g_thread = nullptr;
  }
  SwitchTo(&me->sp, me, next);
  // Resumed: whoever switched here set current and g_thread.
}

void DescribeThread(char* out, size_t n, const Fiber& f) {
  std::snprintf(out, n, "thread (%u,%u,%u) [warp %d lane %d]", f.ids.thread_idx.x, f.ids.thread_idx.y,
                f.ids.thread_idx.z, f.ids.warp, f.ids.lane);
}

[[noreturn]] void Abort() {
  std::fflush(stdout);
  std::fflush(stderr);
  std::abort();
}

void CompleteBlockBarrier() {
  g_exec.barrier_result_count = g_exec.barrier_count;
  g_exec.barrier_result_threads = g_exec.live;
  g_exec.barrier_arrived = 0;
  g_exec.barrier_count = 0;
  for (int i = 0; i < g_exec.num_threads; ++i) {
    Fiber& f = g_exec.fibers[i];
    if (f.state == FiberState::kBarrier) f.state = FiberState::kReady;
  }
}

[[noreturn]] void FiberExit(Fiber* me) {
  me->state = FiberState::kDone;
  --g_exec.live;
  Warp& w = g_exec.warps[me->ids.warp];
  ++w.exited;
  if (w.arrived[0] || w.arrived[1]) {
    const Collective op = w.op[w.arrived[0] ? 0 : 1];
    char who[96];
    DescribeThread(who, sizeof(who), *me);
    internal::Fail("%s returned while other lanes of its warp wait in %s (all 32 lanes must take part)", who,
                   CollectiveName(op));
  }
  // An exited thread no longer holds back __syncthreads.
  if (g_exec.barrier_arrived > 0 && g_exec.barrier_arrived == g_exec.live) CompleteBlockBarrier();
  Reschedule();
  __builtin_unreachable();
}

void DeadlockAbort() {
  std::fprintf(stderr,
               "kvflow CUDA emulator: DEADLOCK in kernel %s, block (%u,%u,%u): no thread can make progress. "
               "%d of %d threads have not exited:\n",
               KernelName(), g_block.block_idx.x, g_block.block_idx.y, g_block.block_idx.z, g_exec.live,
               g_exec.num_threads);
  // Runs of consecutive threads in the same state, e.g. "threads 0..39 wait in __syncthreads".
  auto where = [](const Fiber& f) -> std::string {
    switch (f.state) {
      case FiberState::kDone: return "exited";
      case FiberState::kBarrier: return "wait in __syncthreads";
      case FiberState::kWarp: return std::string("wait in ") + CollectiveName(f.waiting_op);
      case FiberState::kReady: return "ready (emulator bug)";
    }
    return "?";
  };
  int lines = 0;
  for (int i = 0; i < g_exec.num_threads && lines < 32;) {
    const std::string state = where(g_exec.fibers[i]);
    int j = i + 1;
    while (j < g_exec.num_threads && where(g_exec.fibers[j]) == state) ++j;
    std::fprintf(stderr, "  threads %d..%d (linear ids; warps %d..%d) %s\n", i, j - 1, i / 32, (j - 1) / 32,
                 state.c_str());
    i = j;
    ++lines;
  }
  for (size_t w = 0; w < g_exec.warps.size(); ++w) {
    const Warp& warp = g_exec.warps[w];
    const int arrived = std::max(warp.arrived[0], warp.arrived[1]);
    if (arrived > 0)
      std::fprintf(stderr, "  warp %zu: %d of %d lanes in %s, %d lanes exited\n", w, arrived, warp.lanes,
                   CollectiveName(warp.op[warp.arrived[0] ? 0 : 1]), warp.exited);
  }
  std::fprintf(stderr,
               "  (a __syncthreads or warp collective that not every thread reaches, e.g. inside a branch "
               "or after an early return of some lanes)\n");
  Abort();
}

void RunBlock(const KernelLaunch& launch) {
  const int n = g_exec.num_threads;
  const dim3 b = launch.block;
  for (int t = 0; t < n; ++t) {
    Fiber& f = g_exec.fibers[t];
    f.ids.thread_idx = make_uint3(t % b.x, (t / b.x) % b.y, t / (b.x * b.y));
    f.ids.linear_id = t;
    f.ids.lane = t % 32;
    f.ids.warp = t / 32;
    f.ids.warp_lanes = std::min(32, n - f.ids.warp * 32);
    f.state = FiberState::kReady;
    f.collective_seq = 0;
    PrepareFiber(f);
  }
  for (Warp& w : g_exec.warps) {
    w.arrived[0] = w.arrived[1] = 0;
    w.exited = 0;
  }
  g_exec.live = n;
  g_exec.barrier_arrived = 0;
  g_exec.barrier_count = 0;
  if (launch.dynamic_smem) std::memset(g_block.dynamic_smem, 0xCD, launch.dynamic_smem);
  Fiber* first = &g_exec.fibers[g_exec.reverse ? n - 1 : 0];
  g_exec.current = first;
  g_thread = &first->ids;
  ++g_stats.context_switches;
#if KVFLOW_EMU_ASM_SWITCH
  kvflow_emu_switch_context(&g_exec.main_sp, first->sp);
#else
  swapcontext(&g_exec.main_context, &first->context);
#endif
  g_thread = nullptr;
  g_exec.current = nullptr;
  if (g_exec.live != 0) DeadlockAbort();
}

// Order in which a block's threads run between barriers. Alternating per block makes a missing
// __syncthreads show up whichever side of it the reader is on; `flipped` is the alternation's
// complement, so a launch of one block (or one whose reader sits in even blocks) runs in both
// orders across a default and a flipped run (CI runs the emulator suite both ways).
enum class Schedule { kForward, kReverse, kAlternate, kFlipped };
Schedule ScheduleFromEnv() {
  const char* v = std::getenv("KVFLOW_EMU_SCHEDULE");
  if (!v || !*v || std::strcmp(v, "alternate") == 0) return Schedule::kAlternate;
  if (std::strcmp(v, "forward") == 0) return Schedule::kForward;
  if (std::strcmp(v, "reverse") == 0) return Schedule::kReverse;
  if (std::strcmp(v, "flipped") == 0) return Schedule::kFlipped;
  internal::Fail("KVFLOW_EMU_SCHEDULE=%s: expected forward, reverse, alternate or flipped", v);
}

void RunKernel(const KernelLaunch& launch) {
  static const Schedule schedule = ScheduleFromEnv();
  if (g_exec.in_kernel) {
    internal::Fail("kernel launch from inside a kernel (dynamic parallelism) is not supported");
  }
  InstallStackOverflowHandler();
  const int n = static_cast<int>(launch.block.x * launch.block.y * launch.block.z);
  EnsureStacks(n);
  g_exec.num_threads = n;
  const int num_warps = (n + 31) / 32;
  g_exec.warps.resize(num_warps);
  for (int w = 0; w < num_warps; ++w) {
    g_exec.warps[w].lanes = std::min(32, n - w * 32);
    g_exec.warps[w].lane_mask = g_exec.warps[w].lanes == 32 ? 0xffffffffu : (1u << g_exec.warps[w].lanes) - 1u;
  }
  if (g_exec.smem_storage.size() < launch.dynamic_smem + 16) g_exec.smem_storage.resize(launch.dynamic_smem + 16);
  void* smem = g_exec.smem_storage.data();
  size_t space = g_exec.smem_storage.size();
  g_block.dynamic_smem = launch.dynamic_smem ? std::align(16, launch.dynamic_smem, smem, space) : nullptr;
  g_block.dynamic_smem_bytes = launch.dynamic_smem;
  g_block.block_dim = launch.block;
  g_block.grid_dim = launch.grid;
  g_exec.launch = &launch;
  g_exec.kernel_name.clear();
  g_exec.in_kernel = true;
  ++g_stats.launches;
  for (unsigned z = 0; z < launch.grid.z; ++z) {
    for (unsigned y = 0; y < launch.grid.y; ++y) {
      for (unsigned x = 0; x < launch.grid.x; ++x) {
        g_block.block_idx = make_uint3(x, y, z);
        const bool odd = ((x + y + z) & 1) != 0;
        g_exec.reverse = schedule == Schedule::kReverse || (schedule == Schedule::kAlternate && odd) ||
                         (schedule == Schedule::kFlipped && !odd);
        RunBlock(launch);
        ++g_stats.blocks;
        g_stats.threads += n;
      }
    }
  }
  g_exec.in_kernel = false;
  CheckGuardsAfterKernel();
  g_exec.launch = nullptr;
}

// ---- tensor cores ---------------------------------------------------------------------------------------

float HalfBitsToFloat(uint16_t bits) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
float Bf16BitsToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// All 65536 fp16 values as floats (GEMMs and mma convert a lot of them).
const float* HalfTable() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = HalfBitsToFloat(static_cast<uint16_t>(i));
    return t;
  }();
  return table.data();
}

struct MmaSlot {
  uint32_t a[4];
  uint32_t b[2];
  float d[4];
  int is_fp16;
};
static_assert(sizeof(MmaSlot) <= sizeof(LaneSlot));

void ComputeMma(LaneSlot* slots) {
  MmaSlot lane[32];
  for (int l = 0; l < 32; ++l) std::memcpy(&lane[l], slots[l].bytes, sizeof(MmaSlot));
  const bool fp16 = lane[0].is_fp16 != 0;
  for (int l = 1; l < 32; ++l) {
    if ((lane[l].is_fp16 != 0) != fp16) internal::Fail("mma: lanes disagree on fp16 vs bf16 inputs (lane %d)", l);
  }
  const float* half_table = HalfTable();
  auto lo = [&](uint32_t v) { return fp16 ? half_table[v & 0xffff] : Bf16BitsToFloat(v & 0xffff); };
  auto hi = [&](uint32_t v) { return fp16 ? half_table[v >> 16] : Bf16BitsToFloat(v >> 16); };
  float a[16][16], b[16][8], c[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    const MmaSlot& s = lane[l];
    a[g][2 * t] = lo(s.a[0]);
    a[g][2 * t + 1] = hi(s.a[0]);
    a[g + 8][2 * t] = lo(s.a[1]);
    a[g + 8][2 * t + 1] = hi(s.a[1]);
    a[g][2 * t + 8] = lo(s.a[2]);
    a[g][2 * t + 9] = hi(s.a[2]);
    a[g + 8][2 * t + 8] = lo(s.a[3]);
    a[g + 8][2 * t + 9] = hi(s.a[3]);
    b[2 * t][g] = lo(s.b[0]);
    b[2 * t + 1][g] = hi(s.b[0]);
    b[2 * t + 8][g] = lo(s.b[1]);
    b[2 * t + 9][g] = hi(s.b[1]);
    c[g][2 * t] = s.d[0];
    c[g][2 * t + 1] = s.d[1];
    c[g + 8][2 * t] = s.d[2];
    c[g + 8][2 * t + 1] = s.d[3];
  }
  // Each element sums in k order, starting from C; products of 16-bit values are exact in fp32.
  for (int r = 0; r < 16; ++r) {
    for (int k = 0; k < 16; ++k) {
      const float ark = a[r][k];
      for (int col = 0; col < 8; ++col) c[r][col] += ark * b[k][col];
    }
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    const float d[4] = {c[g][2 * t], c[g][2 * t + 1], c[g + 8][2 * t], c[g + 8][2 * t + 1]};
    std::memcpy(slots[l].bytes + offsetof(MmaSlot, d), d, sizeof(d));
  }
}

struct LdMatrixSlot {
  const void* row;
  int num;
  int trans;
};
static_assert(sizeof(LdMatrixSlot) <= sizeof(LaneSlot));

// ---- device memory ---------------------------------------------------------------------------------------

constexpr size_t kAllocAlign = 256;
constexpr size_t kGuardBytes = 256;
constexpr unsigned char kGuardByte = 0xA5;
constexpr size_t kPoisonLimit = size_t{64} << 20;  // larger buffers stay zero (not committed)
constexpr size_t kMmapThreshold = size_t{1} << 20;

struct Allocation {
  char* base = nullptr;
  size_t mapped = 0;  // bytes at base
  size_t size = 0;    // user bytes, at base + kGuardBytes
  bool mmapped = false;
};
std::map<uintptr_t, Allocation> g_allocations;  // by user address
size_t g_live_bytes = 0;
std::set<void*> g_pinned;
std::set<cudaStream_t> g_streams;
std::set<cudaEvent_t> g_events;
std::set<cudaGraph_t> g_graphs;
std::set<cudaGraphExec_t> g_graph_execs;
std::vector<Capture*> g_captures;
std::unordered_map<const void*, int> g_func_max_dynamic_smem;

size_t TotalDeviceMemory() {
  static const size_t total = EnvBytes("KVFLOW_EMU_DEVICE_MEMORY", size_t{8} << 30);
  return total;
}

const unsigned char* GuardPattern() {
  static const std::vector<unsigned char> pattern(kGuardBytes + kAllocAlign, kGuardByte);
  return pattern.data();
}

// The first damaged guard byte of `a` (as an offset from the user pointer), or INT64_MIN if intact.
int64_t FindGuardDamage(const Allocation& a) {
  const unsigned char* pattern = GuardPattern();
  const char* user = a.base + kGuardBytes;
  if (std::memcmp(a.base, pattern, kGuardBytes) != 0) {
    for (size_t i = 0; i < kGuardBytes; ++i)
      if (static_cast<unsigned char>(a.base[i]) != kGuardByte) return static_cast<int64_t>(i) - static_cast<int64_t>(kGuardBytes);
  }
  const size_t back = a.mapped - kGuardBytes - a.size;
  if (std::memcmp(user + a.size, pattern, back) != 0) {
    for (size_t i = 0; i < back; ++i)
      if (static_cast<unsigned char>(user[a.size + i]) != kGuardByte) return static_cast<int64_t>(a.size + i);
  }
  return INT64_MIN;
}

void ReportGuardDamage(const Allocation& a, int64_t offset, const char* context) {
  std::fprintf(stderr,
               "kvflow CUDA emulator: OUT-OF-BOUNDS WRITE detected %s: byte %lld of the %zu-byte cudaMalloc "
               "buffer at %p (%s its end) was overwritten\n",
               context, static_cast<long long>(offset), a.size, static_cast<void*>(a.base + kGuardBytes),
               offset < 0 ? "before" : "past");
  Abort();
}

// Guard bytes of every buffer: a kernel that wrote just outside one is named here.
void CheckGuardsAfterKernel() {
  for (const auto& [user, a] : g_allocations) {
    const int64_t damage = FindGuardDamage(a);
    if (damage != INT64_MIN) {
      const std::string context = std::string("after kernel ") + KernelName();
      ReportGuardDamage(a, damage, context.c_str());
    }
  }
}

// The allocation that contains [p, p + bytes), or nullptr. `partial` says whether p lies in an
// allocation although the range does not fit.
const Allocation* FindDeviceRange(const void* p, size_t bytes, bool* partial = nullptr) {
  if (partial) *partial = false;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  auto it = g_allocations.upper_bound(addr);
  if (it == g_allocations.begin()) return nullptr;
  --it;
  const Allocation& a = it->second;
  const uintptr_t user = it->first;
  if (addr < user || addr >= user + std::max<size_t>(a.size, 1)) return nullptr;
  if (addr + bytes > user + a.size) {
    if (partial) *partial = true;
    return nullptr;
  }
  return &a;
}

bool CheckDeviceRange(const char* api, const char* which, const void* p, size_t bytes) {
  if (bytes == 0) return true;
  bool partial = false;
  if (FindDeviceRange(p, bytes, &partial)) return true;
  Warn("%s: %s range [%p, +%zu bytes) is %s", api, which, p, bytes,
       partial ? "not inside its cudaMalloc buffer (overrun)" : "not device memory from cudaMalloc");
  return false;
}
// With cudaMemcpyDefault a pointer may be host memory; a device pointer's range must still fit.
bool CheckMaybeDeviceRange(const char* api, const char* which, const void* p, size_t bytes) {
  if (bytes == 0) return true;
  bool partial = false;
  FindDeviceRange(p, bytes, &partial);
  if (!partial) return true;
  Warn("%s: %s range [%p, +%zu bytes) overruns its cudaMalloc buffer", api, which, p, bytes);
  return false;
}

bool CheckCopy(const char* api, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  switch (kind) {
    case cudaMemcpyHostToHost: return true;
    case cudaMemcpyHostToDevice: return CheckDeviceRange(api, "destination", dst, bytes);
    case cudaMemcpyDeviceToHost: return CheckDeviceRange(api, "source", src, bytes);
    case cudaMemcpyDeviceToDevice:
      return CheckDeviceRange(api, "destination", dst, bytes) && CheckDeviceRange(api, "source", src, bytes);
    case cudaMemcpyDefault:
      return CheckMaybeDeviceRange(api, "destination", dst, bytes) && CheckMaybeDeviceRange(api, "source", src, bytes);
  }
  Warn("%s: invalid cudaMemcpyKind %d", api, static_cast<int>(kind));
  return false;
}

// ---- streams and capture --------------------------------------------------------------------------------

bool IsDefaultStream(cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread; }
bool IsKnownStream(cudaStream_t s) { return IsDefaultStream(s) || g_streams.count(s) != 0; }

Capture* CaptureOf(cudaStream_t s) { return IsDefaultStream(s) ? nullptr : s->capture; }

// A capture that forbids "unsafe" calls (legacy-stream work, synchronous copies) from this thread.
Capture* ProhibitingCapture() {
  for (Capture* c : g_captures) {
    if (c->mode == cudaStreamCaptureModeGlobal) return c;
    if (c->mode == cudaStreamCaptureModeThreadLocal && c->thread == std::this_thread::get_id()) return c;
  }
  return nullptr;
}

// Work for `stream`: records it into the stream's capture, or runs it now. Returns the error.
cudaError_t Submit(cudaStream_t stream, std::function<void()> work) {
  if (!IsKnownStream(stream)) return cudaErrorInvalidResourceHandle;
  if (Capture* c = CaptureOf(stream)) {
    if (c->invalidated) return cudaErrorStreamCaptureInvalidated;
    c->nodes.push_back(std::move(work));
    return cudaSuccess;
  }
  if (stream == nullptr || stream == cudaStreamLegacy) {
    // The legacy stream synchronizes with every stream, so it cannot run while one captures.
    if (Capture* c = ProhibitingCapture()) {
      c->invalidated = true;
      return cudaErrorStreamCaptureImplicit;
    }
  }
  work();
  return cudaSuccess;
}

// Synchronous runtime calls (cudaMemcpy, cudaDeviceSynchronize, ...) during a capture.
cudaError_t CheckSyncAllowed() {
  if (Capture* c = ProhibitingCapture()) {
    c->invalidated = true;
    return cudaErrorStreamCaptureUnsupported;
  }
  return cudaSuccess;
}

}  // namespace

// ---- public helpers ---------------------------------------------------------------------------------------

namespace internal {

void Fail(const char* format, ...) {
  std::fflush(stdout);
  std::va_list args;
  va_start(args, format);
  std::fprintf(stderr, "kvflow CUDA emulator: ERROR in kernel %s", KernelName());
  if (g_exec.in_kernel) {
    std::fprintf(stderr, ", block (%u,%u,%u)", g_block.block_idx.x, g_block.block_idx.y, g_block.block_idx.z);
    if (g_thread)
      std::fprintf(stderr, ", thread (%u,%u,%u) [warp %d lane %d]", g_thread->thread_idx.x, g_thread->thread_idx.y,
                   g_thread->thread_idx.z, g_thread->warp, g_thread->lane);
  }
  std::fprintf(stderr, ":\n  ");
  std::vfprintf(stderr, format, args);
  std::fprintf(stderr, "\n");
  va_end(args);
  Abort();
}

const LaneSlot* WarpExchange(Collective op, unsigned mask, const void* value, size_t size) {
  Fiber* me = g_exec.current;
  if (!g_exec.in_kernel || !me) {
    std::fprintf(stderr, "kvflow CUDA emulator: %s called outside a kernel\n", CollectiveName(op));
    Abort();
  }
  Warp& w = g_exec.warps[me->ids.warp];
  if ((mask & w.lane_mask) != w.lane_mask) {
    Fail("%s with mask 0x%08x: the emulator supports full-warp masks only (all %d lanes of the warp)",
         CollectiveName(op), mask, w.lanes);
  }
  if (w.exited) {
    Fail("%s: %d lane(s) of this warp already returned; all lanes must take part in a warp collective",
         CollectiveName(op), w.exited);
  }
  const int b = me->collective_seq & 1;
  ++me->collective_seq;
  if (w.arrived[b] == 0) {
    w.op[b] = op;
    w.size[b] = size;
  } else if (w.op[b] != op || w.size[b] != size) {
    Fail("lanes of one warp are in different collectives: this lane is in %s (%zu bytes), others in %s (%zu "
         "bytes) (divergent collective?)",
         CollectiveName(op), size, CollectiveName(w.op[b]), w.size[b]);
  }
  if (size) std::memcpy(w.slots[b][me->ids.lane].bytes, value, size);
  if (++w.arrived[b] == w.lanes) {
    // Last lane: complete the collective and release the others; this lane goes on.
    w.arrived[b] = 0;
    if (op == Collective::kMma) ComputeMma(w.slots[b]);
    const int first = me->ids.warp * 32;
    for (int l = 0; l < w.lanes; ++l) {
      Fiber& f = g_exec.fibers[first + l];
      if (f.state == FiberState::kWarp) f.state = FiberState::kReady;
    }
    return w.slots[b];
  }
  me->state = FiberState::kWarp;
  me->waiting_op = op;
  Reschedule();
  return w.slots[b];
}

int SyncThreads(int reduce_op, int predicate) {
  Fiber* me = g_exec.current;
  if (!g_exec.in_kernel || !me) {
    std::fprintf(stderr, "kvflow CUDA emulator: __syncthreads called outside a kernel\n");
    Abort();
  }
  g_exec.barrier_count += predicate != 0;
  if (++g_exec.barrier_arrived == g_exec.live) {
    CompleteBlockBarrier();
  } else {
    me->state = FiberState::kBarrier;
    Reschedule();
  }
  // Valid until the next barrier completes, which needs this thread again.
  const int count = g_exec.barrier_result_count;
  switch (reduce_op) {
    case 1: return count == g_exec.barrier_result_threads;
    case 2: return count != 0;
    default: return count;
  }
}

int LaunchImpl(const void* kernel, const char* signature, dim3 grid, dim3 block, size_t dynamic_smem,
               void* stream_ptr, std::function<void()> body) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  if (g_exec.in_kernel) Fail("kernel launch from inside a kernel (dynamic parallelism) is not supported");
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64 || grid.x == 0 ||
      grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    Warn("launch of %s: invalid configuration grid (%u,%u,%u) block (%u,%u,%u)",
         SymbolName(kernel).empty() ? signature : SymbolName(kernel).c_str(), grid.x, grid.y, grid.z, block.x,
         block.y, block.z);
    return SetError(cudaErrorInvalidConfiguration);
  }
  if (dynamic_smem > 232448) {
    Warn("launch of %s: %zu bytes of dynamic shared memory (at most 232448 = 227 KiB)",
         SymbolName(kernel).empty() ? signature : SymbolName(kernel).c_str(), dynamic_smem);
    return SetError(cudaErrorInvalidValue);
  }
  auto launch = std::make_shared<KernelLaunch>();
  launch->kernel = kernel;
  launch->signature = signature;
  launch->grid = grid;
  launch->block = block;
  launch->dynamic_smem = dynamic_smem;
  launch->body = std::move(body);
  const cudaError_t e = Submit(static_cast<cudaStream_t>(stream_ptr), [launch] { RunKernel(*launch); });
  return SetError(e);
}

}  // namespace internal

void MmaM16N8K16(bool is_fp16, float d[4], const uint32_t a[4], const uint32_t b[2]) {
  MmaSlot in{};
  std::memcpy(in.a, a, sizeof(in.a));
  std::memcpy(in.b, b, sizeof(in.b));
  std::memcpy(in.d, d, sizeof(in.d));
  in.is_fp16 = is_fp16;
  if (g_thread && g_thread->warp_lanes != 32) internal::Fail("mma needs a full warp of 32 threads");
  const LaneSlot* slots = internal::WarpExchange(Collective::kMma, 0xffffffffu, &in, sizeof(in));
  std::memcpy(d, slots[g_thread->lane].bytes + offsetof(MmaSlot, d), 4 * sizeof(float));
}

void LdMatrix(int num, bool trans, uint32_t* r, const void* smem_row) {
  if (num != 1 && num != 2 && num != 4) internal::Fail("ldmatrix: .x%d is not .x1, .x2 or .x4", num);
  if (g_thread && g_thread->warp_lanes != 32) internal::Fail("ldmatrix needs a full warp of 32 threads");
  const LdMatrixSlot in{smem_row, num, trans ? 1 : 0};
  const LaneSlot* slots = internal::WarpExchange(Collective::kLdMatrix, 0xffffffffu, &in, sizeof(in));
  LdMatrixSlot lanes[32];
  for (int l = 0; l < 32; ++l) std::memcpy(&lanes[l], slots[l].bytes, sizeof(LdMatrixSlot));
  const int me = g_thread->lane;
  for (int l = 0; l < 32; ++l) {
    if (lanes[l].num != num || lanes[l].trans != in.trans)
      internal::Fail("ldmatrix: lanes disagree on the variant (lane %d: .x%d%s, lane %d: .x%d%s)", me, num,
                     trans ? ".trans" : "", l, lanes[l].num, lanes[l].trans ? ".trans" : "");
  }
  for (int l = 0; l < 8 * num; ++l) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(lanes[l].row);
    if (p == 0 || p % 16 != 0)
      internal::Fail("ldmatrix.x%d: lane %d passed row address %p, which is not 16-byte aligned (or null)", num, l,
                     lanes[l].row);
  }
  const int group = me / 4, pair = me % 4;
  for (int i = 0; i < num; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      const auto* row = static_cast<const uint16_t*>(lanes[8 * i + group].row);
      lo = row[2 * pair];
      hi = row[2 * pair + 1];
    } else {
      lo = static_cast<const uint16_t*>(lanes[8 * i + 2 * pair].row)[group];
      hi = static_cast<const uint16_t*>(lanes[8 * i + 2 * pair + 1].row)[group];
    }
    r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
}

size_t LiveDeviceBytes() {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return g_live_bytes;
}
size_t LiveDeviceAllocations() {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return g_allocations.size();
}
void CheckAllGuards(const char* context) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  for (const auto& [user, a] : g_allocations) {
    const int64_t damage = FindGuardDamage(a);
    if (damage != INT64_MIN) ReportGuardDamage(a, damage, context);
  }
}
Stats GetStats() {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  return g_stats;
}

// ---- cuBLAS GEMM core -------------------------------------------------------------------------------------

namespace {

float LoadElement(const void* p, size_t index, cudaDataType t) {
  switch (t) {
    case CUDA_R_32F: return static_cast<const float*>(p)[index];
    case CUDA_R_16F: return HalfTable()[static_cast<const uint16_t*>(p)[index]];
    case CUDA_R_16BF: return Bf16BitsToFloat(static_cast<const uint16_t*>(p)[index]);
    default: return 0.0f;
  }
}
void StoreElement(void* p, size_t index, cudaDataType t, float v) {
  switch (t) {
    case CUDA_R_32F: static_cast<float*>(p)[index] = v; break;
    case CUDA_R_16F: static_cast<__half*>(p)[index] = __float2half_rn(v); break;
    case CUDA_R_16BF: static_cast<__nv_bfloat16*>(p)[index] = __float2bfloat16_rn(v); break;
    default: break;
  }
}
bool SupportedType(cudaDataType t) { return t == CUDA_R_32F || t == CUDA_R_16F || t == CUDA_R_16BF; }

typedef float Vec8 __attribute__((vector_size(32)));
constexpr int kMr = 8;    // rows of op(A) per micro-tile (one Vec8)
constexpr int kNr = 4;    // columns of op(B) per micro-tile
constexpr int kKc = 256;  // depth of one packed panel
constexpr int kMc = 128;  // rows of one packed A panel
constexpr int kNc = 512;  // columns of one packed B panel

// acc(8 x 4) += Apanel(8 x kc) * Bpanel(kc x 4); a: kc Vec8 (rows contiguous), b: kc x 4.
__attribute__((target_clones("arch=haswell", "default"))) void MicroKernel(int kc, const float* a, const float* b,
                                                                          float* c_tile) {
  Vec8 acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
  for (int k = 0; k < kc; ++k) {
    Vec8 av;
    std::memcpy(&av, a + k * kMr, sizeof(av));
    const float* bk = b + k * kNr;
    acc0 += av * bk[0];
    acc1 += av * bk[1];
    acc2 += av * bk[2];
    acc3 += av * bk[3];
  }
  std::memcpy(c_tile + 0 * kMr, &acc0, sizeof(acc0));
  std::memcpy(c_tile + 1 * kMr, &acc1, sizeof(acc1));
  std::memcpy(c_tile + 2 * kMr, &acc2, sizeof(acc2));
  std::memcpy(c_tile + 3 * kMr, &acc3, sizeof(acc3));
}

struct GemmArgs {
  bool trans_a, trans_b;
  int m, n, k;
  float alpha, beta;
  const void* a;
  cudaDataType a_type;
  int64_t lda;
  const void* b;
  cudaDataType b_type;
  int64_t ldb;
  void* c;
  cudaDataType c_type;
  int64_t ldc;
};

// C = alpha * op(A) * op(B) + beta * C, column-major, fp32 accumulation (C is not read when beta == 0).
void Gemm(const GemmArgs& g) {
  const int m = g.m, n = g.n, k = g.k;
  if (m <= 0 || n <= 0) return;
  auto a_at = [&](int i, int p) -> size_t {  // op(A)[i][p]
    return g.trans_a ? static_cast<size_t>(p) + static_cast<size_t>(i) * g.lda
                     : static_cast<size_t>(i) + static_cast<size_t>(p) * g.lda;
  };
  auto b_at = [&](int p, int j) -> size_t {  // op(B)[p][j]
    return g.trans_b ? static_cast<size_t>(j) + static_cast<size_t>(p) * g.ldb
                     : static_cast<size_t>(p) + static_cast<size_t>(j) * g.ldb;
  };
  std::vector<float> acc(static_cast<size_t>(m) * n, 0.0f);  // column-major m x n
  std::vector<float> a_pack(static_cast<size_t>(kMc) * kKc), b_pack(static_cast<size_t>(kNc) * kKc);
  float tile[kMr * kNr];
  for (int jc = 0; jc < n; jc += kNc) {
    const int nc = std::min(kNc, n - jc);
    const int n_strips = (nc + kNr - 1) / kNr;
    for (int pc = 0; pc < k; pc += kKc) {
      const int kc = std::min(kKc, k - pc);
      // B panel: strips of kNr columns, each kc x kNr row-major, zero-padded.
      for (int s = 0; s < n_strips; ++s) {
        float* dst = b_pack.data() + static_cast<size_t>(s) * kc * kNr;
        for (int jj = 0; jj < kNr; ++jj) {
          const int j = jc + s * kNr + jj;
          for (int p = 0; p < kc; ++p)
            dst[p * kNr + jj] = j < jc + nc ? LoadElement(g.b, b_at(pc + p, j), g.b_type) : 0.0f;
        }
      }
      for (int ic = 0; ic < m; ic += kMc) {
        const int mc = std::min(kMc, m - ic);
        const int m_strips = (mc + kMr - 1) / kMr;
        // A panel: strips of kMr rows, each kc x kMr (rows contiguous), zero-padded.
        for (int s = 0; s < m_strips; ++s) {
          float* dst = a_pack.data() + static_cast<size_t>(s) * kc * kMr;
          for (int ii = 0; ii < kMr; ++ii) {
            const int i = ic + s * kMr + ii;
            if (i < ic + mc) {
              for (int p = 0; p < kc; ++p) dst[p * kMr + ii] = LoadElement(g.a, a_at(i, pc + p), g.a_type);
            } else {
              for (int p = 0; p < kc; ++p) dst[p * kMr + ii] = 0.0f;
            }
          }
        }
        for (int sj = 0; sj < n_strips; ++sj) {
          const float* bp = b_pack.data() + static_cast<size_t>(sj) * kc * kNr;
          for (int si = 0; si < m_strips; ++si) {
            MicroKernel(kc, a_pack.data() + static_cast<size_t>(si) * kc * kMr, bp, tile);
            const int i0 = ic + si * kMr, j0 = jc + sj * kNr;
            const int rows = std::min(kMr, m - i0), cols = std::min(kNr, n - j0);
            for (int jj = 0; jj < cols; ++jj) {
              float* col = acc.data() + static_cast<size_t>(j0 + jj) * m + i0;
              for (int ii = 0; ii < rows; ++ii) col[ii] += tile[jj * kMr + ii];
            }
          }
        }
      }
    }
  }
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      const size_t ci = static_cast<size_t>(i) + static_cast<size_t>(j) * g.ldc;
      float v = g.alpha * acc[static_cast<size_t>(j) * m + i];
      if (g.beta != 0.0f) v += g.beta * LoadElement(g.c, ci, g.c_type);
      StoreElement(g.c, ci, g.c_type, v);
    }
  }
}

size_t TypeBytes(cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; }

float ReadScalar(const void* p, cublasComputeType_t compute) {
  if (compute == CUBLAS_COMPUTE_16F || compute == CUBLAS_COMPUTE_16F_PEDANTIC)
    return __half2float(*static_cast<const __half*>(p));
  return *static_cast<const float*>(p);
}

bool SupportedCompute(cublasComputeType_t c) {
  switch (c) {
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
    case CUBLAS_COMPUTE_32F_FAST_16F:
    case CUBLAS_COMPUTE_32F_FAST_16BF:
    case CUBLAS_COMPUTE_32F_FAST_TF32:
    case CUBLAS_COMPUTE_16F:
    case CUBLAS_COMPUTE_16F_PEDANTIC:
      return true;
    default:
      return false;
  }
}

cublasStatus_t GemmBatched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                           int k, const void* alpha, const void* A, cudaDataType a_type, int lda, long long stride_a,
                           const void* B, cudaDataType b_type, int ldb, long long stride_b, const void* beta, void* C,
                           cudaDataType c_type, int ldc, long long stride_c, int batch,
                           cublasComputeType_t compute) {
  std::lock_guard<std::recursive_mutex> lock(g_mu);
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!SupportedType(a_type) || !SupportedType(b_type) || !SupportedType(c_type) || !SupportedCompute(compute)) {
    Warn("cublasGemmEx: unsupported types (A %d, B %d, C %d, compute %d)", a_type, b_type, c_type, compute);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  auto op_ok = [](cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C; };
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  const int a_rows = ta ? k : m, b_rows = tb ? n : k;
  if (!op_ok(transa) || !op_ok(transb) || m < 0 || n < 0 || k < 0 || batch < 0 || lda < std::max(1, a_rows) ||
      ldb < std::max(1, b_rows) || ldc < std::max(1, m) || !alpha || !beta) {
    Warn("cublasGemmEx: invalid value (m %d n %d k %d lda %d ldb %d ldc %d)", m, n, k, lda, ldb, ldc);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
  // Device ranges of the operands (checked when the call is made, as far as they can be).
  const size_t a_cols = ta ? m : k, b_cols = tb ? k : n;
  for (int i = 0; i < batch; ++i) {
    const size_t a_bytes = a_cols ? ((a_cols - 1) * lda + a_rows) * TypeBytes(a_type) : 0;
    const size_t b_bytes = b_cols ? ((b_cols - 1) * ldb + b_rows) * TypeBytes(b_type) : 0;
    const size_t c_bytes = ((static_cast<size_t>(n) - 1) * ldc + m) * TypeBytes(c_type);
    if (!CheckMaybeDeviceRange("cublasGemmEx", "A", static_cast<const char*>(A) + i * stride_a * TypeBytes(a_type), a_bytes) ||
        !CheckMaybeDeviceRange("cublasGemmEx", "B", static_cast<const char*>(B) + i * stride_b * TypeBytes(b_type), b_bytes) ||
        !CheckMaybeDeviceRange("cublasGemmEx", "C", static_cast<char*>(C) + i * stride_c * TypeBytes(c_type), c_bytes))
      return CUBLAS_STATUS_INVALID_VALUE;
  }
  // Host pointer mode: the scalars are read now (a captured graph keeps these values).
  const bool device_scalars = handle->pointer_mode == CUBLAS_POINTER_MODE_DEVICE;
  const float alpha_now = device_scalars ? 0.0f : ReadScalar(alpha, compute);
  const float beta_now = device_scalars ? 0.0f : ReadScalar(beta, compute);
  auto work = [=] {
    GemmArgs g{ta, tb, m, n, k, device_scalars ? ReadScalar(alpha, compute) : alpha_now,
               device_scalars ? ReadScalar(beta, compute) : beta_now, nullptr, a_type, lda, nullptr, b_type, ldb,
               nullptr, c_type, ldc};
    for (int i = 0; i < batch; ++i) {
      g.a = static_cast<const char*>(A) + i * stride_a * TypeBytes(a_type);
      g.b = static_cast<const char*>(B) + i * stride_b * TypeBytes(b_type);
      g.c = static_cast<char*>(C) + i * stride_c * TypeBytes(c_type);
      Gemm(g);
    }
  };
  const cudaError_t e = Submit(handle->stream, work);
  return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

}  // namespace
}  // namespace kvflow_emu

long long int clock64() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---- CUDA runtime API ----------------------------------------------------------------------------------------

using kvflow_emu::g_mu;
using Lock = std::lock_guard<std::recursive_mutex>;
namespace emu = kvflow_emu;

namespace {
bool CheckCopy2D(const char* api, void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                 cudaMemcpyKind kind) {
  if (width > dpitch || width > spitch) {
    emu::Warn("%s: width %zu exceeds a pitch (dst %zu, src %zu)", api, width, dpitch, spitch);
    return false;
  }
  if (height == 0 || width == 0) return true;
  const size_t dst_span = dpitch * (height - 1) + width, src_span = spitch * (height - 1) + width;
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (dst_dev ? !emu::CheckDeviceRange(api, "destination", dst, dst_span)
              : !emu::CheckMaybeDeviceRange(api, "destination", dst, dst_span))
    return false;
  if (src_dev ? !emu::CheckDeviceRange(api, "source", src, src_span)
              : !emu::CheckMaybeDeviceRange(api, "source", src, src_span))
    return false;
  return true;
}
void Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height) {
  for (size_t r = 0; r < height; ++r)
    std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
}
}  // namespace

extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = emu::t_last_error;
  emu::t_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return emu::t_last_error; }

#define KVFLOW_EMU_ERRORS(X)                                                                      \
  X(cudaSuccess, "no error")                                                                      \
  X(cudaErrorInvalidValue, "invalid argument")                                                    \
  X(cudaErrorMemoryAllocation, "out of memory")                                                   \
  X(cudaErrorInitializationError, "initialization error")                                         \
  X(cudaErrorInvalidConfiguration, "invalid configuration argument")                              \
  X(cudaErrorInvalidPitchValue, "invalid pitch argument")                                         \
  X(cudaErrorInvalidSymbol, "invalid device symbol")                                              \
  X(cudaErrorInvalidHostPointer, "invalid host pointer")                                          \
  X(cudaErrorInvalidDevicePointer, "invalid device pointer")                                      \
  X(cudaErrorInvalidMemcpyDirection, "invalid copy direction for memcpy")                         \
  X(cudaErrorInvalidDeviceFunction, "invalid device function")                                    \
  X(cudaErrorNoDevice, "no CUDA-capable device is detected")                                      \
  X(cudaErrorInvalidDevice, "invalid device ordinal")                                             \
  X(cudaErrorInvalidResourceHandle, "invalid resource handle")                                    \
  X(cudaErrorNotReady, "device not ready")                                                        \
  X(cudaErrorIllegalAddress, "an illegal memory access was encountered")                          \
  X(cudaErrorLaunchOutOfResources, "too many resources requested for launch")                     \
  X(cudaErrorLaunchFailure, "unspecified launch failure")                                         \
  X(cudaErrorNotSupported, "operation not supported")                                             \
  X(cudaErrorNotPermitted, "operation not permitted")                                             \
  X(cudaErrorHostMemoryAlreadyRegistered, "part or all of the requested memory range is already mapped") \
  X(cudaErrorHostMemoryNotRegistered, "pointer does not correspond to a registered memory region") \
  X(cudaErrorStreamCaptureUnsupported, "operation not permitted when stream is capturing")        \
  X(cudaErrorStreamCaptureInvalidated, "operation failed due to a previous error during capture") \
  X(cudaErrorStreamCaptureMerge, "operation would result in a merge of separate capture sequences") \
  X(cudaErrorStreamCaptureUnmatched, "capture was not initiated in this stream")                  \
  X(cudaErrorStreamCaptureUnjoined, "capturing stream has unjoined work")                         \
  X(cudaErrorStreamCaptureIsolation, "dependency created on uncaptured work in another stream")   \
  X(cudaErrorStreamCaptureImplicit, "operation would make the legacy stream depend on a capturing blocking stream") \
  X(cudaErrorCapturedEvent, "operation not permitted on an event last recorded in a capturing stream") \
  X(cudaErrorStreamCaptureWrongThread, "attempt to terminate a thread-local capture sequence from another thread") \
  X(cudaErrorIllegalState, "the operation cannot be performed in the present state")           \
  X(cudaErrorInvalidResourceType, "invalid resource type")                                        \
  X(cudaErrorLaunchTimeout, "the launch timed out and was terminated")                            \
  X(cudaErrorMisalignedAddress, "misaligned address")                                             \
  X(cudaErrorAssert, "device-side assert triggered")                                              \
  X(cudaErrorUnknown, "unknown error")

const char* cudaGetErrorString(cudaError_t error) {
#define KVFLOW_EMU_STRING(code, text) \
  case code: return text;
  switch (error) {
    KVFLOW_EMU_ERRORS(KVFLOW_EMU_STRING)
    default: return "unrecognized error code";
  }
#undef KVFLOW_EMU_STRING
}
const char* cudaGetErrorName(cudaError_t error) {
#define KVFLOW_EMU_NAME(code, text) \
  case code: return #code;
  switch (error) {
    KVFLOW_EMU_ERRORS(KVFLOW_EMU_NAME)
    default: return "cudaErrorUnknown";
  }
#undef KVFLOW_EMU_NAME
}

// ---- device ----

namespace kvflow_emu {
// KVFLOW_EMU_DEVICES emulated devices (default 1), read at every call so that a test may set it
// before its first CUDA call. They share one memory (host memory, one KVFLOW_EMU_DEVICE_MEMORY
// budget); the current device is per host thread, as in CUDA.
int DeviceCount() {
  const char* v = std::getenv("KVFLOW_EMU_DEVICES");
  const int n = v != nullptr ? std::atoi(v) : 1;
  return std::clamp(n, 1, 16);
}
thread_local int t_current_device = 0;
bool ValidDevice(int device) { return device >= 0 && device < DeviceCount(); }
}  // namespace kvflow_emu

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return emu::SetError(cudaErrorInvalidValue);
  *count = emu::DeviceCount();
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  if (!device) return emu::SetError(cudaErrorInvalidValue);
  *device = emu::t_current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (!emu::ValidDevice(device)) return emu::SetError(cudaErrorInvalidDevice);
  emu::t_current_device = device;
  return cudaSuccess;
}
cudaError_t cudaSetDeviceFlags(unsigned int) { return cudaSuccess; }
cudaError_t cudaDeviceReset(void) { return cudaSuccess; }
cudaError_t cudaDeviceSetLimit(enum cudaLimit, size_t) { return cudaSuccess; }
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  if (!can) return emu::SetError(cudaErrorInvalidValue);
  if (!emu::ValidDevice(device) || !emu::ValidDevice(peer)) return emu::SetError(cudaErrorInvalidDevice);
  *can = device != peer ? 1 : 0;  // one memory: every pair of emulated devices can
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  if (flags != 0) return emu::SetError(cudaErrorInvalidValue);
  if (!emu::ValidDevice(peer) || peer == emu::t_current_device) return emu::SetError(cudaErrorInvalidDevice);
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  if (!v) return emu::SetError(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  if (!v) return emu::SetError(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  if (!prop) return emu::SetError(cudaErrorInvalidValue);
  if (!emu::ValidDevice(device)) return emu::SetError(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name), "kvflow CUDA emulator (CPU)");
  prop->totalGlobalMem = emu::TotalDeviceMemory();
  prop->sharedMemPerBlock = 49152;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->memPitch = 2147483647;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 2147483647;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->totalConstMem = 65536;
  prop->major = 9;
  prop->minor = 0;
  prop->textureAlignment = 512;
  prop->multiProcessorCount = 132;
  prop->integrated = 0;
  prop->canMapHostMemory = 1;
  prop->concurrentKernels = 1;
  prop->asyncEngineCount = 2;
  prop->unifiedAddressing = 1;
  prop->memoryBusWidth = 5120;
  prop->l2CacheSize = 50 * 1024 * 1024;
  prop->persistingL2CacheMaxSize = 0;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->streamPrioritiesSupported = 1;
  prop->sharedMemPerMultiprocessor = 233472;
  prop->regsPerMultiprocessor = 65536;
  prop->sharedMemPerBlockOptin = 232448;
  prop->maxBlocksPerMultiProcessor = 32;
  prop->reservedSharedMemPerBlock = 1024;
  prop->cooperativeLaunch = 1;
  prop->hostRegisterSupported = 1;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  if (!value) return emu::SetError(cudaErrorInvalidValue);
  if (!emu::ValidDevice(device)) return emu::SetError(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxBlockDimX: *value = 1024; break;
    case cudaDevAttrMaxBlockDimY: *value = 1024; break;
    case cudaDevAttrMaxBlockDimZ: *value = 64; break;
    case cudaDevAttrMaxGridDimX: *value = 2147483647; break;
    case cudaDevAttrMaxGridDimY: *value = 65535; break;
    case cudaDevAttrMaxGridDimZ: *value = 65535; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 49152; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 232448; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = 233472; break;
    case cudaDevAttrTotalConstantMemory: *value = 65536; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMaxRegistersPerBlock: *value = 65536; break;
    case cudaDevAttrMaxRegistersPerMultiprocessor: *value = 65536; break;
    case cudaDevAttrClockRate: *value = 1980000; break;
    case cudaDevAttrMemoryClockRate: *value = 2619000; break;
    case cudaDevAttrGlobalMemoryBusWidth: *value = 5120; break;
    case cudaDevAttrL2CacheSize: *value = 50 * 1024 * 1024; break;
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
    case cudaDevAttrMaxBlocksPerMultiprocessor: *value = 32; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrConcurrentKernels: *value = 1; break;
    case cudaDevAttrAsyncEngineCount: *value = 2; break;
    case cudaDevAttrUnifiedAddressing: *value = 1; break;
    case cudaDevAttrIntegrated: *value = 0; break;
    case cudaDevAttrCanMapHostMemory: *value = 1; break;
    case cudaDevAttrComputeMode: *value = cudaComputeModeDefault; break;
    case cudaDevAttrCooperativeLaunch: *value = 1; break;
    case cudaDevAttrStreamPrioritiesSupported: *value = 1; break;
    case cudaDevAttrMemoryPoolsSupported: *value = 0; break;
    case cudaDevAttrPageableMemoryAccess: *value = 0; break;
    case cudaDevAttrManagedMemory: *value = 0; break;
    default: *value = 0; break;
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  Lock lock(g_mu);
  return emu::SetError(emu::CheckSyncAllowed());
}

// ---- memory ----

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  Lock lock(g_mu);
  const size_t total = emu::TotalDeviceMemory();
  if (free_bytes) *free_bytes = total > emu::g_live_bytes ? total - emu::g_live_bytes : 0;
  if (total_bytes) *total_bytes = total;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** dev_ptr, size_t size) {
  Lock lock(g_mu);
  if (!dev_ptr) return emu::SetError(cudaErrorInvalidValue);
  *dev_ptr = nullptr;
  if (Capture* c = emu::ProhibitingCapture(); c && c->mode == cudaStreamCaptureModeGlobal) {
    c->invalidated = true;
    return emu::SetError(cudaErrorStreamCaptureUnsupported);
  }
  if (size == 0) return cudaSuccess;
  const size_t total = emu::TotalDeviceMemory();
  if (size > total || emu::g_live_bytes > total - size) return emu::SetError(cudaErrorMemoryAllocation);
  const size_t rounded = (size + emu::kAllocAlign - 1) / emu::kAllocAlign * emu::kAllocAlign;
  emu::Allocation a;
  a.size = size;
  a.mapped = emu::kGuardBytes + rounded + emu::kGuardBytes;
  if (a.mapped >= emu::kMmapThreshold) {
    void* p = mmap(nullptr, a.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return emu::SetError(cudaErrorMemoryAllocation);
    a.base = static_cast<char*>(p);
    a.mmapped = true;
  } else {
    void* p = nullptr;
    if (posix_memalign(&p, emu::kAllocAlign, a.mapped) != 0) return emu::SetError(cudaErrorMemoryAllocation);
    a.base = static_cast<char*>(p);
  }
  char* user = a.base + emu::kGuardBytes;
  std::memset(a.base, emu::kGuardByte, emu::kGuardBytes);
  std::memset(user + size, emu::kGuardByte, a.mapped - emu::kGuardBytes - size);
  // Fresh device memory is garbage on a GPU: NaN bytes make reads of unwritten memory show.
  if (size <= emu::kPoisonLimit) std::memset(user, 0xFF, size);
  emu::g_allocations[reinterpret_cast<uintptr_t>(user)] = a;
  emu::g_live_bytes += size;
  *dev_ptr = user;
  return cudaSuccess;
}

cudaError_t cudaFree(void* dev_ptr) {
  Lock lock(g_mu);
  if (!dev_ptr) return cudaSuccess;
  auto it = emu::g_allocations.find(reinterpret_cast<uintptr_t>(dev_ptr));
  if (it == emu::g_allocations.end()) {
    emu::Warn("cudaFree(%p): not a live cudaMalloc pointer (double free?)", dev_ptr);
    return emu::SetError(cudaErrorInvalidValue);
  }
  const emu::Allocation a = it->second;
  const int64_t damage = emu::FindGuardDamage(a);
  if (damage != INT64_MIN) emu::ReportGuardDamage(a, damage, "at cudaFree");
  emu::g_allocations.erase(it);
  emu::g_live_bytes -= a.size;
  if (a.mmapped) {
    munmap(a.base, a.mapped);
  } else {
    std::free(a.base);
  }
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void** dev_ptr, size_t size, cudaStream_t stream) {
  Lock lock(g_mu);
  if (emu::CaptureOf(stream)) return emu::SetError(cudaErrorStreamCaptureUnsupported);
  return cudaMalloc(dev_ptr, size);
}
cudaError_t cudaFreeAsync(void* dev_ptr, cudaStream_t stream) {
  Lock lock(g_mu);
  if (emu::CaptureOf(stream)) return emu::SetError(cudaErrorStreamCaptureUnsupported);
  return cudaFree(dev_ptr);
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  Lock lock(g_mu);
  if (!ptr) return emu::SetError(cudaErrorInvalidValue);
  *ptr = nullptr;
  if (size == 0) return cudaSuccess;
  void* p = nullptr;
  if (posix_memalign(&p, 4096, size) != 0) return emu::SetError(cudaErrorMemoryAllocation);
  emu::g_pinned.insert(p);
  *ptr = p;
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int) { return cudaMallocHost(ptr, size); }
cudaError_t cudaFreeHost(void* ptr) {
  Lock lock(g_mu);
  if (!ptr) return cudaSuccess;
  if (!emu::g_pinned.erase(ptr)) {
    emu::Warn("cudaFreeHost(%p): not a live cudaMallocHost pointer", ptr);
    return emu::SetError(cudaErrorInvalidValue);
  }
  std::free(ptr);
  return cudaSuccess;
}
cudaError_t cudaHostGetDevicePointer(void** device, void* host, unsigned int) {
  if (!device) return emu::SetError(cudaErrorInvalidValue);
  *device = host;
  return cudaSuccess;
}
cudaError_t cudaHostRegister(void*, size_t, unsigned int) { return cudaSuccess; }
cudaError_t cudaHostUnregister(void*) { return cudaSuccess; }

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* attributes, const void* ptr) {
  Lock lock(g_mu);
  if (!attributes) return emu::SetError(cudaErrorInvalidValue);
  std::memset(attributes, 0, sizeof(*attributes));
  if (emu::FindDeviceRange(ptr, 1)) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = 0;
    attributes->devicePointer = const_cast<void*>(ptr);
  } else {
    bool pinned = false;
    auto it = emu::g_pinned.upper_bound(const_cast<void*>(ptr));
    if (it != emu::g_pinned.begin() && *std::prev(it) == ptr) pinned = true;
    attributes->type = pinned ? cudaMemoryTypeHost : cudaMemoryTypeUnregistered;
    attributes->device = 0;
    attributes->hostPointer = const_cast<void*>(ptr);
    if (pinned) attributes->devicePointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  Lock lock(g_mu);
  if (const cudaError_t e = emu::CheckSyncAllowed(); e != cudaSuccess) return emu::SetError(e);
  if (!emu::CheckCopy("cudaMemcpy", dst, src, count, kind)) return emu::SetError(cudaErrorInvalidValue);
  if (count) std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream) {
  Lock lock(g_mu);
  if (!emu::CheckCopy("cudaMemcpyAsync", dst, src, count, kind)) return emu::SetError(cudaErrorInvalidValue);
  return emu::SetError(emu::Submit(stream, [dst, src, count, kind] {
    if (!emu::CheckCopy("cudaMemcpyAsync (replayed)", dst, src, count, kind)) {
      std::fprintf(stderr, "kvflow CUDA emulator: a captured cudaMemcpyAsync touches freed memory\n");
      emu::Abort();
    }
    if (count) std::memmove(dst, src, count);
  }));
}

cudaError_t cudaMemcpyPeer(void* dst, int dst_device, const void* src, int src_device, size_t count) {
  if (!emu::ValidDevice(dst_device) || !emu::ValidDevice(src_device)) return emu::SetError(cudaErrorInvalidDevice);
  return cudaMemcpy(dst, src, count, cudaMemcpyDeviceToDevice);
}
cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                                cudaStream_t stream) {
  if (!emu::ValidDevice(dst_device) || !emu::ValidDevice(src_device)) return emu::SetError(cudaErrorInvalidDevice);
  return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
}


cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                         enum cudaMemcpyKind kind) {
  Lock lock(g_mu);
  if (const cudaError_t e = emu::CheckSyncAllowed(); e != cudaSuccess) return emu::SetError(e);
  if (!CheckCopy2D("cudaMemcpy2D", dst, dpitch, src, spitch, width, height, kind))
    return emu::SetError(width > dpitch || width > spitch ? cudaErrorInvalidPitchValue : cudaErrorInvalidValue);
  Copy2D(dst, dpitch, src, spitch, width, height);
  return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t stream) {
  Lock lock(g_mu);
  if (!CheckCopy2D("cudaMemcpy2DAsync", dst, dpitch, src, spitch, width, height, kind))
    return emu::SetError(width > dpitch || width > spitch ? cudaErrorInvalidPitchValue : cudaErrorInvalidValue);
  return emu::SetError(
      emu::Submit(stream, [=] { Copy2D(dst, dpitch, src, spitch, width, height); }));
}

cudaError_t cudaMemset(void* dev_ptr, int value, size_t count) {
  Lock lock(g_mu);
  if (const cudaError_t e = emu::CheckSyncAllowed(); e != cudaSuccess) return emu::SetError(e);
  if (!emu::CheckDeviceRange("cudaMemset", "destination", dev_ptr, count)) return emu::SetError(cudaErrorInvalidValue);
  if (count) std::memset(dev_ptr, value, count);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dev_ptr, int value, size_t count, cudaStream_t stream) {
  Lock lock(g_mu);
  if (!emu::CheckDeviceRange("cudaMemsetAsync", "destination", dev_ptr, count))
    return emu::SetError(cudaErrorInvalidValue);
  return emu::SetError(emu::Submit(stream, [dev_ptr, value, count] {
    if (count) std::memset(dev_ptr, value, count);
  }));
}

// ---- kernels ----

cudaError_t cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
  Lock lock(g_mu);
  if (!func) return emu::SetError(cudaErrorInvalidDeviceFunction);
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > 232448) return emu::SetError(cudaErrorInvalidValue);
    emu::g_func_max_dynamic_smem[func] = value;
  }
  return cudaSuccess;
}

cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes* attr, const void* func) {
  Lock lock(g_mu);
  if (!attr || !func) return emu::SetError(cudaErrorInvalidValue);
  std::memset(attr, 0, sizeof(*attr));
  attr->maxThreadsPerBlock = 1024;
  attr->numRegs = 32;
  attr->ptxVersion = 90;
  attr->binaryVersion = 90;
  auto it = emu::g_func_max_dynamic_smem.find(func);
  attr->maxDynamicSharedSizeBytes = it == emu::g_func_max_dynamic_smem.end() ? 49152 : it->second;
  return cudaSuccess;
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* num_blocks, const void*, int block_size,
                                                          size_t dynamic_smem) {
  if (!num_blocks || block_size <= 0) return emu::SetError(cudaErrorInvalidValue);
  int blocks = std::min(32, 2048 / block_size);
  if (dynamic_smem) blocks = std::min<int>(blocks, static_cast<int>(233472 / (dynamic_smem + 1024)));
  *num_blocks = std::max(blocks, 0);
  return cudaSuccess;
}

// Argument types are unknown here: kernels launch through kvflow_emu::Launch (LaunchKernel).
cudaError_t cudaLaunchKernel(const void*, dim3, dim3, void**, size_t, cudaStream_t) {
  emu::Warn("cudaLaunchKernel is not supported: launch through kvflow::cuda::LaunchKernel (device_utils.cuh)");
  return emu::SetError(cudaErrorNotSupported);
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) {
  Lock lock(g_mu);
  if (!fn) return emu::SetError(cudaErrorInvalidValue);
  return emu::SetError(emu::Submit(stream, [fn, user_data] { fn(user_data); }));
}
cudaError_t cudaStreamAddCallback(cudaStream_t stream, cudaStreamCallback_t callback, void* user_data, unsigned int) {
  Lock lock(g_mu);
  if (!callback) return emu::SetError(cudaErrorInvalidValue);
  if (emu::CaptureOf(stream)) return emu::SetError(cudaErrorStreamCaptureUnsupported);
  if (!emu::IsKnownStream(stream)) return emu::SetError(cudaErrorInvalidResourceHandle);
  callback(stream, cudaSuccess, user_data);
  return cudaSuccess;
}

// ---- streams ----

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int priority) {
  Lock lock(g_mu);
  if (!stream) return emu::SetError(cudaErrorInvalidValue);
  auto* s = new CUstream_st;
  s->flags = flags;
  s->priority = priority;
  emu::g_streams.insert(s);
  *stream = s;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  return cudaStreamCreateWithPriority(stream, flags, 0);
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithPriority(stream, 0, 0); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Lock lock(g_mu);
  if (emu::IsDefaultStream(stream) || !emu::g_streams.count(stream)) return emu::SetError(cudaErrorInvalidResourceHandle);
  if (stream->capture) {
    emu::Warn("cudaStreamDestroy of a stream that is being captured");
    stream->capture->invalidated = true;
  }
  emu::g_streams.erase(stream);
  delete stream;
  return cudaSuccess;
}

cudaError_t cudaStreamGetFlags(cudaStream_t stream, unsigned int* flags) {
  Lock lock(g_mu);
  if (!flags) return emu::SetError(cudaErrorInvalidValue);
  if (!emu::IsKnownStream(stream)) return emu::SetError(cudaErrorInvalidResourceHandle);
  *flags = emu::IsDefaultStream(stream) ? 0 : stream->flags;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Lock lock(g_mu);
  if (!emu::IsKnownStream(stream)) return emu::SetError(cudaErrorInvalidResourceHandle);
  if (Capture* c = emu::CaptureOf(stream)) {
    c->invalidated = true;
    return emu::SetError(cudaErrorStreamCaptureUnsupported);
  }
  if (stream == nullptr || stream == cudaStreamLegacy) return emu::SetError(emu::CheckSyncAllowed());
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  Lock lock(g_mu);
  if (!emu::IsKnownStream(stream)) return emu::SetError(cudaErrorInvalidResourceHandle);
  if (emu::CaptureOf(stream)) return emu::SetError(cudaErrorStreamCaptureUnsupported);
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  Lock lock(g_mu);
  if (!emu::IsKnownStream(stream) || !emu::g_events.count(event)) return emu::SetError(cudaErrorInvalidResourceHandle);
  Capture* c = event->recorded_in_capture;
  if (c && std::find(emu::g_captures.begin(), emu::g_captures.end(), c) != emu::g_captures.end()) {
    // Waiting on an event recorded during a capture pulls this stream into the capture (fork).
    if (emu::IsDefaultStream(stream)) return emu::SetError(cudaErrorStreamCaptureImplicit);
    if (stream->capture && stream->capture != c) return emu::SetError(cudaErrorStreamCaptureMerge);
    if (!stream->capture) {
      stream->capture = c;
      c->joined.push_back(stream);
    }
  }
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  Lock lock(g_mu);
  if (emu::IsDefaultStream(stream)) return emu::SetError(cudaErrorStreamCaptureUnsupported);
  if (!emu::g_streams.count(stream)) return emu::SetError(cudaErrorInvalidResourceHandle);
  if (stream->capture) return emu::SetError(cudaErrorIllegalState);
  auto* c = new Capture;
  c->origin = stream;
  c->mode = mode;
  c->thread = std::this_thread::get_id();
  stream->capture = c;
  emu::g_captures.push_back(c);
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  Lock lock(g_mu);
  if (!graph) return emu::SetError(cudaErrorInvalidValue);
  *graph = nullptr;
  if (emu::IsDefaultStream(stream) || !emu::g_streams.count(stream)) return emu::SetError(cudaErrorInvalidResourceHandle);
  Capture* c = stream->capture;
  if (!c) return emu::SetError(cudaErrorIllegalState);
  if (c->origin != stream) return emu::SetError(cudaErrorStreamCaptureUnmatched);
  if (c->mode == cudaStreamCaptureModeThreadLocal && c->thread != std::this_thread::get_id())
    return emu::SetError(cudaErrorStreamCaptureWrongThread);
  stream->capture = nullptr;
  for (cudaStream_t s : c->joined)
    if (emu::g_streams.count(s)) s->capture = nullptr;
  for (cudaEvent_t e : emu::g_events)
    if (e->recorded_in_capture == c) e->recorded_in_capture = nullptr;
  emu::g_captures.erase(std::find(emu::g_captures.begin(), emu::g_captures.end(), c));
  const bool invalidated = c->invalidated;
  if (!invalidated) {
    auto* g = new CUgraph_st;
    g->nodes = std::move(c->nodes);
    emu::g_graphs.insert(g);
    *graph = g;
  }
  delete c;
  return invalidated ? emu::SetError(cudaErrorStreamCaptureInvalidated) : cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* status) {
  Lock lock(g_mu);
  if (!status) return emu::SetError(cudaErrorInvalidValue);
  if (!emu::IsKnownStream(stream)) return emu::SetError(cudaErrorInvalidResourceHandle);
  if (emu::IsDefaultStream(stream)) {
    // Asking about the legacy stream while another stream captures is itself an implicit dependency.
    if ((stream == nullptr || stream == cudaStreamLegacy) && emu::ProhibitingCapture()) {
      *status = cudaStreamCaptureStatusNone;
      return emu::SetError(cudaErrorStreamCaptureImplicit);
    }
    *status = cudaStreamCaptureStatusNone;
    return cudaSuccess;
  }
  const Capture* c = stream->capture;
  *status = !c ? cudaStreamCaptureStatusNone
               : (c->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive);
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode* mode) {
  if (!mode) return emu::SetError(cudaErrorInvalidValue);
  std::swap(*mode, emu::t_capture_mode);
  return cudaSuccess;
}

// ---- events ----

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  Lock lock(g_mu);
  if (!event) return emu::SetError(cudaErrorInvalidValue);
  auto* e = new CUevent_st;
  e->flags = flags;
  emu::g_events.insert(e);
  *event = e;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  Lock lock(g_mu);
  if (!emu::g_events.erase(event)) return emu::SetError(cudaErrorInvalidResourceHandle);
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  Lock lock(g_mu);
  if (!emu::g_events.count(event) || !emu::IsKnownStream(stream)) return emu::SetError(cudaErrorInvalidResourceHandle);
  if (Capture* c = emu::CaptureOf(stream)) {
    event->recorded_in_capture = c;
    c->nodes.push_back([event] {
      // Replayed: timestamps the event if it still exists.
      if (emu::g_events.count(event)) {
        event->recorded = true;
        event->time = std::chrono::steady_clock::now();
      }
    });
    return cudaSuccess;
  }
  event->recorded = true;
  event->recorded_in_capture = nullptr;
  event->time = std::chrono::steady_clock::now();
  return cudaSuccess;
}
cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int) {
  return cudaEventRecord(event, stream);
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  Lock lock(g_mu);
  if (!emu::g_events.count(event)) return emu::SetError(cudaErrorInvalidResourceHandle);
  if (event->recorded_in_capture) return emu::SetError(cudaErrorCapturedEvent);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  Lock lock(g_mu);
  if (!emu::g_events.count(event)) return emu::SetError(cudaErrorInvalidResourceHandle);
  if (event->recorded_in_capture) return emu::SetError(cudaErrorCapturedEvent);
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  Lock lock(g_mu);
  if (!ms) return emu::SetError(cudaErrorInvalidValue);
  if (!emu::g_events.count(start) || !emu::g_events.count(end)) return emu::SetError(cudaErrorInvalidResourceHandle);
  if ((start->flags | end->flags) & cudaEventDisableTiming) return emu::SetError(cudaErrorInvalidResourceHandle);
  if (!start->recorded || !end->recorded) return emu::SetError(cudaErrorInvalidResourceHandle);
  *ms = std::chrono::duration<float, std::milli>(end->time - start->time).count();
  return cudaSuccess;
}

// ---- graphs ----

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  Lock lock(g_mu);
  if (!exec) return emu::SetError(cudaErrorInvalidValue);
  if (!emu::g_graphs.count(graph)) return emu::SetError(cudaErrorInvalidResourceHandle);
  auto* x = new CUgraphExec_st;
  x->nodes = graph->nodes;
  emu::g_graph_execs.insert(x);
  *exec = x;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
  return cudaGraphInstantiate(exec, graph, flags);
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  Lock lock(g_mu);
  if (!emu::g_graph_execs.count(exec)) return emu::SetError(cudaErrorInvalidResourceHandle);
  // The nodes are copied: replay does not depend on the exec staying alive while captured.
  std::vector<std::function<void()>> nodes = exec->nodes;
  return emu::SetError(emu::Submit(stream, [nodes = std::move(nodes)] {
    for (const auto& node : nodes) node();
  }));
}
cudaError_t cudaGraphUpload(cudaGraphExec_t exec, cudaStream_t) {
  Lock lock(g_mu);
  return emu::g_graph_execs.count(exec) ? cudaSuccess : emu::SetError(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  Lock lock(g_mu);
  if (!emu::g_graph_execs.erase(exec)) return emu::SetError(cudaErrorInvalidResourceHandle);
  delete exec;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  Lock lock(g_mu);
  if (!emu::g_graphs.erase(graph)) return emu::SetError(cudaErrorInvalidResourceHandle);
  delete graph;
  return cudaSuccess;
}

// ---- cuBLAS ----

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetVersion_v2(cublasHandle_t, int* version) {
  if (!version) return CUBLAS_STATUS_INVALID_VALUE;
  *version = CUBLAS_VERSION;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* stream) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!stream) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->math_mode;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->pointer_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t* mode) {
  if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->pointer_mode;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void*, size_t) {
  return handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}
const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR: return "error detected trying to check the license";
  }
  return "unknown error";
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t) {
  return emu::GemmBatched(handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta, C, Ctype,
                          ldc, 0, 1, computeType);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B, cudaDataType Btype, int ldb,
                                          long long int strideB, const void* beta, void* C, cudaDataType Ctype,
                                          int ldc, long long int strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t) {
  return emu::GemmBatched(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB,
                          beta, C, Ctype, ldc, strideC, batchCount, computeType);
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                              int k, const float* alpha, const float* A, int lda, const float* B, int ldb,
                              const float* beta, float* C, int ldc) {
  return emu::GemmBatched(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, 0, B, CUDA_R_32F, ldb, 0, beta,
                          C, CUDA_R_32F, ldc, 0, 1, CUBLAS_COMPUTE_32F);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                         int m, int n, int k, const float* alpha, const float* A, int lda,
                                         long long int strideA, const float* B, int ldb, long long int strideB,
                                         const float* beta, float* C, int ldc, long long int strideC, int batchCount) {
  return emu::GemmBatched(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, strideA, B, CUDA_R_32F, ldb,
                          strideB, beta, C, CUDA_R_32F, ldc, strideC, batchCount, CUBLAS_COMPUTE_32F);
}

}  // extern "C"
