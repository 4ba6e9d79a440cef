// SHA-256 of result bytes (measure.hpp), with OpenSSL's libcrypto (Debian: libssl-dev): runs are
// compared by the hash of rank 0's merged output and LSE, which every JSON record carries.
#include <openssl/evp.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "treeattn/measure.hpp"

namespace treeattn {

std::string sha256_hex(std::span<const std::byte> bytes) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1 ||
      EVP_DigestUpdate(ctx.get(), bytes.data(), bytes.size()) != 1 ||
      EVP_DigestFinal_ex(ctx.get(), md, &n) != 1)
    return "";
  std::string hex;
  char buf[3];
  for (unsigned int i = 0; i < n; ++i) {
    std::snprintf(buf, sizeof(buf), "%02x", md[i]);
    hex += buf;
  }
  return hex;
}

std::string output_sha256(const StateBuffer& states) {
  const std::size_t n = states.records(), d = states.head_dim();
  std::vector<float> bytes(n * d + n);  // out [records][d], then lse [records]
  for (std::size_t i = 0; i < n; ++i)
    state_normalize(states.record(i), d, bytes.data() + i * d, bytes.data() + n * d + i);
  return sha256_hex(std::as_bytes(std::span<const float>(bytes)));
}

}  // namespace treeattn
