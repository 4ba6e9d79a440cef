// main() of a minitest program (gtest/gtest.h here): minitest::main_with_args.
#include "gtest/gtest.h"

int main(int argc, char** argv) { return minitest::main_with_args(argc, argv); }
