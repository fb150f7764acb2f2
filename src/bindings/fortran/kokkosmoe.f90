! kokkosmoe: the Fortran module of KokkosMoE, over the C interface (kmoe.h)
! through iso_c_binding. Every function returns the kmoe status (an
! integer(c_int), kmoe_success on success); kmoe_last_error() gives the
! message. Rows are Fortran arrays hidden(d, tokens): column-major (d,
! tokens) is the same memory as the library's row-major [tokens][d], so the
! arrays are passed in place, without a copy (they must be contiguous).
! bf16 rows are integer(c_int16_t) arrays holding the bf16 bits.
!
!   use mpi
!   use kokkosmoe
!   type(kmoe_layer) :: layer
!   st = kmoe_initialize()
!   st = kmoe_layer_create_from_deck(layer, "inputs/quickstart.toml", MPI_COMM_WORLD)
!   st = kmoe_layer_forward(layer, hidden, out)
!   st = kmoe_layer_destroy(layer)
!   st = kmoe_finalize()
module kokkosmoe
  use, intrinsic :: iso_c_binding
  implicit none
  private

  integer(c_int), parameter, public :: kmoe_success = 0
  integer(c_int), parameter, public :: kmoe_error_invalid_argument = 1
  integer(c_int), parameter, public :: kmoe_error_not_initialized = 2
  integer(c_int), parameter, public :: kmoe_error_input = 3
  integer(c_int), parameter, public :: kmoe_error_runtime = 4
  integer(c_int), parameter, public :: kmoe_error_unavailable = 5
  integer(c_int), parameter, public :: kmoe_error_buffer_too_small = 6
  integer(c_int), parameter, public :: kmoe_fp32 = 0, kmoe_bf16 = 1
  integer(c_int), parameter, public :: kmoe_host = 0, kmoe_device = 1
  !> Parameters (kmoe_parameter): one tensor per index. A row-major C tensor
  !> [rows][cols] is the Fortran array (cols, rows): router_weight(d, E),
  !> expert_gate(d, f) of expert e, expert_down(f, d), correction_bias(E).
  integer(c_int), parameter, public :: kmoe_router_weight = 0, kmoe_correction_bias = 1
  integer(c_int), parameter, public :: kmoe_expert_gate = 2, kmoe_expert_up = 3, kmoe_expert_down = 4
  integer(c_int), parameter, public :: kmoe_shared_gate = 5, kmoe_shared_up = 6, kmoe_shared_down = 7

  !> A layer (the C handle).
  type, public :: kmoe_layer
    type(c_ptr) :: handle = c_null_ptr
  end type kmoe_layer

  public :: kmoe_initialize, kmoe_finalize, kmoe_is_initialized, kmoe_last_error, kmoe_version, kmoe_build_configuration
  public :: kmoe_layer_create_from_deck, kmoe_layer_destroy, kmoe_layer_shape, kmoe_layer_forward
  public :: kmoe_layer_deck_rows, kmoe_layer_digest, kmoe_layer_save_weights, kmoe_layer_load_weights
  public :: kmoe_layer_last_step, kmoe_eplb
  public :: kmoe_layer_backward, kmoe_layer_parameter_count, kmoe_layer_get_parameter, kmoe_layer_set_parameter
  public :: kmoe_layer_get_gradient, kmoe_layer_local_experts

  !> What the last forward of a layer did on this rank (kmoe_step_summary).
  type, bind(C), public :: kmoe_step_summary
    integer(c_int64_t) :: tokens
    integer(c_int64_t) :: routes_attempted, routes_accepted, routes_dropped
    integer(c_int64_t) :: dispatch_rows
    integer(c_int64_t) :: same_rank_bytes, intra_node_bytes, inter_node_bytes
    integer(c_int64_t) :: relay_rows
    real(c_double) :: seconds_total, seconds_router, seconds_dispatch, seconds_experts, seconds_combine_exchange, &
                      seconds_combine, seconds_shared_experts
  end type kmoe_step_summary

  !> out = the layer applied to hidden (both (d, tokens), fp32 or bf16 bits).
  interface kmoe_layer_forward
    module procedure forward_fp32, forward_bf16
  end interface kmoe_layer_forward

  !> Collective: tensor `index` of a parameter (0-based: a global expert id,
  !> a shared expert), into an fp32 array of its elements (rank 1 or 2).
  interface kmoe_layer_get_parameter
    module procedure get_parameter_1, get_parameter_2
  end interface kmoe_layer_get_parameter
  !> Collective: sets it (every rank holding a copy passes the same values;
  !> the others may pass an array of size 0 for a routed expert).
  interface kmoe_layer_set_parameter
    module procedure set_parameter_1, set_parameter_2
  end interface kmoe_layer_set_parameter
  !> Collective: its gradient from the last backward.
  interface kmoe_layer_get_gradient
    module procedure get_gradient_1, get_gradient_2
  end interface kmoe_layer_get_gradient

  interface
    integer(c_int) function c_initialize(argc, argv) bind(C, name="kmoe_initialize")
      import :: c_int, c_ptr
      type(c_ptr), value :: argc, argv
    end function
    integer(c_int) function c_finalize() bind(C, name="kmoe_finalize")
      import :: c_int
    end function
    integer(c_int) function c_is_initialized() bind(C, name="kmoe_is_initialized")
      import :: c_int
    end function
    type(c_ptr) function c_last_error() bind(C, name="kmoe_last_error")
      import :: c_ptr
    end function
    type(c_ptr) function c_version() bind(C, name="kmoe_version")
      import :: c_ptr
    end function
    type(c_ptr) function c_build_configuration() bind(C, name="kmoe_build_configuration")
      import :: c_ptr
    end function
    integer(c_int) function c_layer_create_from_deck_f(path, comm, layer) &
        bind(C, name="kmoe_layer_create_from_deck_f")
      import :: c_int, c_char, c_ptr
      character(kind=c_char), dimension(*), intent(in) :: path
      integer(c_int), value :: comm
      type(c_ptr), intent(out) :: layer
    end function
    integer(c_int) function c_layer_destroy(layer) bind(C, name="kmoe_layer_destroy")
      import :: c_int, c_ptr
      type(c_ptr), value :: layer
    end function
    integer(c_int) function c_layer_check(layer, ok, message) bind(C, name="kmoe_layer_check")
      import :: c_int, c_char, c_ptr
      type(c_ptr), value :: layer
      integer(c_int), value :: ok
      character(kind=c_char), dimension(*), intent(in) :: message
    end function
    integer(c_int) function c_layer_shape(layer, hidden, experts, top_k, dtype, tokens_per_rank) &
        bind(C, name="kmoe_layer_shape")
      import :: c_int, c_int32_t, c_int64_t, c_ptr
      type(c_ptr), value :: layer
      integer(c_int64_t), intent(out) :: hidden, tokens_per_rank
      integer(c_int32_t), intent(out) :: experts, top_k
      integer(c_int), intent(out) :: dtype
    end function
    integer(c_int) function c_layer_forward(layer, hidden, tokens, hidden_dim, dtype, memory, out) &
        bind(C, name="kmoe_layer_forward")
      import :: c_int, c_int64_t, c_ptr
      type(c_ptr), value :: layer, hidden, out
      integer(c_int64_t), value :: tokens, hidden_dim
      integer(c_int), value :: dtype, memory
    end function
    integer(c_int) function c_layer_deck_rows(layer, step, hidden, tokens, hidden_dim) &
        bind(C, name="kmoe_layer_deck_rows")
      import :: c_int, c_int32_t, c_int64_t, c_ptr
      type(c_ptr), value :: layer, hidden
      integer(c_int32_t), value :: step
      integer(c_int64_t), value :: tokens, hidden_dim
    end function
    integer(c_int) function c_layer_digest(layer, out, tokens, hidden_dim, digest) bind(C, name="kmoe_layer_digest")
      import :: c_int, c_int64_t, c_ptr, c_char
      type(c_ptr), value :: layer, out
      integer(c_int64_t), value :: tokens, hidden_dim
      character(kind=c_char), dimension(17), intent(out) :: digest
    end function
    integer(c_int) function c_layer_save_weights(layer, path) bind(C, name="kmoe_layer_save_weights")
      import :: c_int, c_char, c_ptr
      type(c_ptr), value :: layer
      character(kind=c_char), dimension(*), intent(in) :: path
    end function
    integer(c_int) function c_layer_load_weights(layer, path) bind(C, name="kmoe_layer_load_weights")
      import :: c_int, c_char, c_ptr
      type(c_ptr), value :: layer
      character(kind=c_char), dimension(*), intent(in) :: path
    end function
    integer(c_int) function c_layer_last_step(layer, summary) bind(C, name="kmoe_layer_last_step")
      import :: c_int, c_ptr, kmoe_step_summary
      type(c_ptr), value :: layer
      type(kmoe_step_summary), intent(out) :: summary
    end function
    integer(c_int) function c_eplb(loads, num_experts, num_slots, num_ranks, num_nodes, groups, slot_expert, slot_rank) &
        bind(C, name="kmoe_eplb")
      import :: c_int, c_int32_t, c_double
      real(c_double), dimension(*), intent(in) :: loads
      integer(c_int32_t), value :: num_experts, num_slots, num_ranks, num_nodes, groups
      integer(c_int32_t), dimension(*), intent(out) :: slot_expert, slot_rank
    end function
    integer(c_int) function c_layer_backward(layer, hidden, dout, tokens, hidden_dim, dtype, memory, dx) &
        bind(C, name="kmoe_layer_backward")
      import :: c_int, c_ptr, c_int64_t
      type(c_ptr), value :: layer, hidden, dout, dx
      integer(c_int64_t), value :: tokens, hidden_dim
      integer(c_int), value :: dtype, memory
    end function
    integer(c_int) function c_layer_parameter_info(layer, parameter, count, ndim, shape) &
        bind(C, name="kmoe_layer_parameter_info")
      import :: c_int, c_ptr, c_int32_t, c_int64_t
      type(c_ptr), value :: layer
      integer(c_int), value :: parameter
      integer(c_int32_t), intent(out) :: count, ndim
      integer(c_int64_t), intent(out) :: shape(2)
    end function
    integer(c_int) function c_layer_get_parameter(layer, parameter, index, values, count) &
        bind(C, name="kmoe_layer_get_parameter")
      import :: c_int, c_ptr, c_int32_t, c_int64_t
      type(c_ptr), value :: layer, values
      integer(c_int), value :: parameter
      integer(c_int32_t), value :: index
      integer(c_int64_t), value :: count
    end function
    integer(c_int) function c_layer_set_parameter(layer, parameter, index, values, count) &
        bind(C, name="kmoe_layer_set_parameter")
      import :: c_int, c_ptr, c_int32_t, c_int64_t
      type(c_ptr), value :: layer, values
      integer(c_int), value :: parameter
      integer(c_int32_t), value :: index
      integer(c_int64_t), value :: count
    end function
    integer(c_int) function c_layer_get_gradient(layer, parameter, index, values, count) &
        bind(C, name="kmoe_layer_get_gradient")
      import :: c_int, c_ptr, c_int32_t, c_int64_t
      type(c_ptr), value :: layer, values
      integer(c_int), value :: parameter
      integer(c_int32_t), value :: index
      integer(c_int64_t), value :: count
    end function
    integer(c_int) function c_layer_local_experts(layer, experts, capacity, count) &
        bind(C, name="kmoe_layer_local_experts")
      import :: c_int, c_ptr, c_int32_t
      type(c_ptr), value :: layer, experts
      integer(c_int32_t), value :: capacity
      integer(c_int32_t), intent(out) :: count
    end function
    integer(c_int) function c_report_error(status, message) bind(C, name="kmoe_report_error")
      import :: c_int, c_char
      integer(c_int), value :: status
      character(kind=c_char), dimension(*), intent(in) :: message
    end function
    integer(c_size_t) function c_strlen(s) bind(C, name="strlen")
      import :: c_size_t, c_ptr
      type(c_ptr), value :: s
    end function
  end interface

contains

  !> A NUL-terminated C string as a Fortran string.
  function from_c(p) result(s)
    type(c_ptr), intent(in) :: p
    character(len=:), allocatable :: s
    character(kind=c_char), pointer :: chars(:)
    integer :: i, n
    n = int(c_strlen(p))
    call c_f_pointer(p, chars, [n])
    allocate(character(len=n) :: s)
    do i = 1, n
      s(i:i) = chars(i)
    end do
  end function from_c

  !> MPI (unless started) and Kokkos (unless started).
  integer(c_int) function kmoe_initialize() result(st)
    st = c_initialize(c_null_ptr, c_null_ptr)
  end function

  integer(c_int) function kmoe_finalize() result(st)
    st = c_finalize()
  end function

  logical function kmoe_is_initialized() result(yes)
    yes = c_is_initialized() /= 0
  end function

  function kmoe_last_error() result(msg)
    character(len=:), allocatable :: msg
    msg = from_c(c_last_error())
  end function

  function kmoe_version() result(v)
    character(len=:), allocatable :: v
    v = from_c(c_version())
  end function

  function kmoe_build_configuration() result(v)
    character(len=:), allocatable :: v
    v = from_c(c_build_configuration())
  end function

  !> Collective over comm (an MPI Fortran communicator handle).
  integer(c_int) function kmoe_layer_create_from_deck(layer, path, comm) result(st)
    type(kmoe_layer), intent(out) :: layer
    character(len=*), intent(in) :: path
    integer, intent(in) :: comm
    st = c_layer_create_from_deck_f(trim(path) // c_null_char, int(comm, c_int), layer%handle)
  end function

  !> Collective: frees the layer.
  integer(c_int) function kmoe_layer_destroy(layer) result(st)
    type(kmoe_layer), intent(inout) :: layer
    st = c_layer_destroy(layer%handle)
    layer%handle = c_null_ptr
  end function

  integer(c_int) function kmoe_layer_shape(layer, hidden, experts, top_k, dtype, tokens_per_rank) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer(c_int64_t), intent(out) :: hidden, tokens_per_rank
    integer(c_int32_t), intent(out) :: experts, top_k
    integer(c_int), intent(out) :: dtype
    st = c_layer_shape(layer%handle, hidden, experts, top_k, dtype, tokens_per_rank)
  end function

  integer(c_int) function forward_fp32(layer, hidden, out) result(st)
    type(kmoe_layer), intent(in) :: layer
    real(c_float), intent(in), target, contiguous :: hidden(:, :)
    real(c_float), intent(inout), target, contiguous :: out(:, :)
    st = check_shapes(layer, shape(hidden), shape(out))
    if (st /= kmoe_success) return
    st = c_layer_forward(layer%handle, c_loc(hidden), int(size(hidden, 2), c_int64_t), &
                         int(size(hidden, 1), c_int64_t), kmoe_fp32, kmoe_host, c_loc(out))
  end function

  integer(c_int) function forward_bf16(layer, hidden, out) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer(c_int16_t), intent(in), target, contiguous :: hidden(:, :)
    integer(c_int16_t), intent(inout), target, contiguous :: out(:, :)
    st = check_shapes(layer, shape(hidden), shape(out))
    if (st /= kmoe_success) return
    st = c_layer_forward(layer%handle, c_loc(hidden), int(size(hidden, 2), c_int64_t), &
                         int(size(hidden, 1), c_int64_t), kmoe_bf16, kmoe_host, c_loc(out))
  end function

  !> Collective: hidden and out must have one shape, (d, tokens), on every
  !> rank; a mismatch on any rank is the same error on all of them (the
  !> forward then checks d and the dtype).
  integer(c_int) function check_shapes(layer, hs, os) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer, intent(in) :: hs(2), os(2)
    character(len=160) :: msg
    integer(c_int) :: ok
    ok = 1
    msg = ''
    if (any(hs /= os)) then
      ok = 0
      write (msg, '(a,i0,a,i0,a,i0,a,i0,a)') 'kmoe_layer_forward: hidden is (', hs(1), ', ', hs(2), &
        ') but out is (', os(1), ', ', os(2), ')'
    end if
    st = c_layer_check(layer%handle, ok, trim(msg) // c_null_char)
  end function

  !> This rank's rows of step `step` of the layer's deck, (d, tokens_per_rank).
  integer(c_int) function kmoe_layer_deck_rows(layer, step, hidden) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer, intent(in) :: step
    real(c_float), intent(inout), target, contiguous :: hidden(:, :)
    st = c_layer_deck_rows(layer%handle, int(step, c_int32_t), c_loc(hidden), int(size(hidden, 2), c_int64_t), &
                           int(size(hidden, 1), c_int64_t))
  end function

  !> Collective: the content digest of every rank's out (16 hex digits).
  integer(c_int) function kmoe_layer_digest(layer, out, digest) result(st)
    type(kmoe_layer), intent(in) :: layer
    real(c_float), intent(in), target, contiguous :: out(:, :)
    character(len=16), intent(out) :: digest
    character(kind=c_char) :: d(17)
    integer :: i
    st = c_layer_digest(layer%handle, c_loc(out), int(size(out, 2), c_int64_t), int(size(out, 1), c_int64_t), d)
    digest = ''
    if (st == kmoe_success) then
      do i = 1, 16
        digest(i:i) = d(i)
      end do
    end if
  end function

  integer(c_int) function kmoe_layer_save_weights(layer, path) result(st)
    type(kmoe_layer), intent(in) :: layer
    character(len=*), intent(in) :: path
    st = c_layer_save_weights(layer%handle, trim(path) // c_null_char)
  end function

  integer(c_int) function kmoe_layer_load_weights(layer, path) result(st)
    type(kmoe_layer), intent(in) :: layer
    character(len=*), intent(in) :: path
    st = c_layer_load_weights(layer%handle, trim(path) // c_null_char)
  end function

  !> The last forward on this rank.
  integer(c_int) function kmoe_layer_last_step(layer, summary) result(st)
    type(kmoe_layer), intent(in) :: layer
    type(kmoe_step_summary), intent(out) :: summary
    st = c_layer_last_step(layer%handle, summary)
  end function

  !> EPLB: a placement of size(loads) experts on size(slot_expert) slots over
  !> num_ranks ranks on num_nodes nodes (groups kept on one node; 1: none).
  !> Expert and rank numbers are 0-based, as in the C interface.
  integer(c_int) function kmoe_eplb(loads, num_ranks, num_nodes, groups, slot_expert, slot_rank) result(st)
    real(c_double), intent(in) :: loads(:)
    integer, intent(in) :: num_ranks, num_nodes, groups
    integer(c_int32_t), intent(out) :: slot_expert(:), slot_rank(:)
    character(len=120) :: msg
    if (size(slot_rank) /= size(slot_expert)) then
      write (msg, '(a,i0,a,i0,a)') 'kmoe_eplb: slot_expert has ', size(slot_expert), ' entries but slot_rank ', &
        size(slot_rank), '; both hold one entry per slot'
      st = c_report_error(kmoe_error_invalid_argument, trim(msg) // c_null_char)
      return
    end if
    st = c_eplb(loads, int(size(loads), c_int32_t), int(size(slot_expert), c_int32_t), int(num_ranks, c_int32_t), &
                int(num_nodes, c_int32_t), int(groups, c_int32_t), slot_expert, slot_rank)
  end function

  !> Collective: dx = the backward of the last forward (on hidden), given
  !> dout; all (d, tokens) fp32 arrays. The parameter gradients stay in the
  !> layer (kmoe_layer_get_gradient).
  integer(c_int) function kmoe_layer_backward(layer, hidden, dout, dx) result(st)
    type(kmoe_layer), intent(in) :: layer
    real(c_float), intent(in), target, contiguous :: hidden(:, :), dout(:, :)
    real(c_float), intent(inout), target, contiguous :: dx(:, :)
    st = check_shapes(layer, shape(hidden), shape(dout))
    if (st /= kmoe_success) return
    st = check_shapes(layer, shape(hidden), shape(dx))
    if (st /= kmoe_success) return
    st = c_layer_backward(layer%handle, c_loc(hidden), c_loc(dout), int(size(hidden, 2), c_int64_t), &
                          int(size(hidden, 1), c_int64_t), kmoe_fp32, kmoe_host, c_loc(dx))
  end function

  !> How many tensors a parameter has, and one tensor's elements.
  integer(c_int) function kmoe_layer_parameter_count(layer, parameter, count, elements) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer(c_int), intent(in) :: parameter
    integer, intent(out) :: count
    integer(c_int64_t), intent(out) :: elements
    integer(c_int32_t) :: n, nd
    integer(c_int64_t) :: s(2)
    s = 1
    st = c_layer_parameter_info(layer%handle, parameter, n, nd, s)
    count = int(n)
    elements = product(s(1:nd))
  end function

  !> The global expert id of each of this rank's routed slots (0-based).
  integer(c_int) function kmoe_layer_local_experts(layer, experts) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer(c_int32_t), allocatable, target, intent(out) :: experts(:)
    integer(c_int32_t) :: n
    st = c_layer_local_experts(layer%handle, c_null_ptr, 0_c_int32_t, n)
    if (st /= kmoe_success) return
    allocate (experts(n))
    if (n == 0) return
    st = c_layer_local_experts(layer%handle, c_loc(experts), n, n)
  end function

  integer(c_int) function get_parameter_1(layer, parameter, index, values) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer(c_int), intent(in) :: parameter
    integer, intent(in) :: index
    real(c_float), intent(inout), target, contiguous :: values(:)
    st = c_layer_get_parameter(layer%handle, parameter, int(index, c_int32_t), c_loc(values), int(size(values), c_int64_t))
  end function
  integer(c_int) function get_parameter_2(layer, parameter, index, values) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer(c_int), intent(in) :: parameter
    integer, intent(in) :: index
    real(c_float), intent(inout), target, contiguous :: values(:, :)
    st = c_layer_get_parameter(layer%handle, parameter, int(index, c_int32_t), c_loc(values), int(size(values), c_int64_t))
  end function
  integer(c_int) function set_parameter_1(layer, parameter, index, values) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer(c_int), intent(in) :: parameter
    integer, intent(in) :: index
    real(c_float), intent(in), target, contiguous :: values(:)
    type(c_ptr) :: p
    p = c_null_ptr
    if (size(values) > 0) p = c_loc(values)
    st = c_layer_set_parameter(layer%handle, parameter, int(index, c_int32_t), p, int(size(values), c_int64_t))
  end function
  integer(c_int) function set_parameter_2(layer, parameter, index, values) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer(c_int), intent(in) :: parameter
    integer, intent(in) :: index
    real(c_float), intent(in), target, contiguous :: values(:, :)
    type(c_ptr) :: p
    p = c_null_ptr
    if (size(values) > 0) p = c_loc(values)
    st = c_layer_set_parameter(layer%handle, parameter, int(index, c_int32_t), p, int(size(values), c_int64_t))
  end function
  integer(c_int) function get_gradient_1(layer, parameter, index, values) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer(c_int), intent(in) :: parameter
    integer, intent(in) :: index
    real(c_float), intent(inout), target, contiguous :: values(:)
    st = c_layer_get_gradient(layer%handle, parameter, int(index, c_int32_t), c_loc(values), int(size(values), c_int64_t))
  end function
  integer(c_int) function get_gradient_2(layer, parameter, index, values) result(st)
    type(kmoe_layer), intent(in) :: layer
    integer(c_int), intent(in) :: parameter
    integer, intent(in) :: index
    real(c_float), intent(inout), target, contiguous :: values(:, :)
    st = c_layer_get_gradient(layer%handle, parameter, int(index, c_int32_t), c_loc(values), int(size(values), c_int64_t))
  end function

end module kokkosmoe
