// Compiled by tests/layers/CMakeLists.txt with PROBE_HEADER set to one header.
#define KVFLOW_STRINGIFY_(x) #x
#define KVFLOW_STRINGIFY(x) KVFLOW_STRINGIFY_(x)
#include KVFLOW_STRINGIFY(PROBE_HEADER)
