#pragma once
// Whether this translation unit is built with AddressSanitizer (GCC defines __SANITIZE_ADDRESS__; Clang
// answers __has_feature(address_sanitizer)). One definition for code and tests that must behave differently
// under it (address-space limits, ASan's own fatal-signal handlers).

namespace kvsim {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

}  // namespace kvsim
