// main() of a minitest program (gtest/gtest.h here): every test; exit status 1 when one failed.
#include "gtest/gtest.h"

int main() { return minitest::run_all().failed > 0 ? 1 : 0; }
