#ifndef KMOE_CATCH_HPP
#define KMOE_CATCH_HPP

// One include for Catch2 v2 (Debian 12) and v3: tests use the v3 spellings
// of Approx and the matchers through this header.

#if KMOE_CATCH2_MAJOR >= 3
#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
using Catch::Approx;
#else
#include <catch2/catch.hpp>  // v2 defines ::Approx itself
#endif

#endif
