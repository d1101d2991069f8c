// The library's error message: thread-local, set by fail() and read through w4p_cuda_last_error().
#pragma once

namespace w4p {

extern thread_local char g_err[512];
// formats the message and returns `code` (a negative W4P_E* code)
int fail(int code, const char *fmt, ...);

}  // namespace w4p
