#include "store/status.h"
