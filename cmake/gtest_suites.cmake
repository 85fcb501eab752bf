# Writes CTEST_FILE with one ctest test per GoogleTest suite of TEST_EXECUTABLE: the suite's
# tests run in one process (--gtest_filter=Suite.*) instead of one process each. Starting a
# test process under ctest costs about 0.1 s (more under ASan), and most of the ~900 tests
# take less than that. Run after each build of the test executable (CMakeLists.txt).
#   cmake -D TEST_EXECUTABLE=... -D CTEST_FILE=... [-D EXCLUDE=A.b:C.d] [-D TIMEOUT=s] -P gtest_suites.cmake
# EXCLUDE: tests left out of every suite, as a GoogleTest negative filter.
# COST (ctest starts costlier tests first): the suite's number of tests.
if(NOT TEST_EXECUTABLE OR NOT CTEST_FILE)
  message(FATAL_ERROR "gtest_suites.cmake: TEST_EXECUTABLE and CTEST_FILE are required")
endif()
if(NOT TIMEOUT)
  set(TIMEOUT 1800)
endif()
execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests OUTPUT_VARIABLE listing
                ERROR_VARIABLE errors RESULT_VARIABLE rc TIMEOUT 60)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gtest_suites.cmake: ${TEST_EXECUTABLE} --gtest_list_tests failed (${rc}): ${errors}")
endif()
string(REPLACE ";" "," listing "${listing}")
string(REPLACE "\n" ";" lines "${listing}")
set(content "")
set(suite "")
set(count 0)
set(total 0)
macro(emit_suite)
  if(NOT suite STREQUAL "")
    set(filter "${suite}.*")
    if(EXCLUDE)
      string(APPEND filter ":-${EXCLUDE}")
    endif()
    string(APPEND content "add_test([=[${suite}]=] [=[${TEST_EXECUTABLE}]=] [=[--gtest_filter=${filter}]=])\n"
           "set_tests_properties([=[${suite}]=] PROPERTIES TIMEOUT ${TIMEOUT} COST ${count})\n")
    math(EXPR total "${total} + ${count}")
  endif()
endmacro()
foreach(line IN LISTS lines)
  if(line MATCHES "^([^ #][^ ]*)\\.( +#.*)?$")  # a suite: "Suite." or "Suite/0.  # TypeParam = ..."
    emit_suite()
    set(suite "${CMAKE_MATCH_1}")
    set(count 0)
  elseif(line MATCHES "^  [^ ]")  # one of its tests
    math(EXPR count "${count} + 1")
  endif()
endforeach()
emit_suite()
if(total EQUAL 0)
  message(FATAL_ERROR "gtest_suites.cmake: no tests listed by ${TEST_EXECUTABLE}")
endif()
file(WRITE "${CTEST_FILE}" "${content}")
