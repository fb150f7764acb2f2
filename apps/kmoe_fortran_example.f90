! kmoe-fortran-example: a layer from a deck, driven from Fortran.
!
!   mpiexec -n 4 kmoe-fortran-example inputs/quickstart.toml
!
! Every rank takes its rows of the deck's first step as a (d, tokens)
! array, runs one forward and prints, on rank 0, the output digest: the
! same as kmoe-layer's output_digest for that deck with --steps 1
! --warmup 0 (the same rows through the same layer, bitwise).
program kmoe_fortran_example
  use mpi
  use kokkosmoe
  use, intrinsic :: iso_c_binding
  implicit none
  type(kmoe_layer) :: layer
  real(c_float), allocatable :: hidden(:, :), out(:, :)
  integer(c_int64_t) :: d, tokens
  integer(c_int32_t) :: experts, top_k
  integer(c_int) :: dtype
  character(len=16) :: digest
  character(len=4096) :: deck
  integer :: rank, ierr

  if (command_argument_count() < 1) then
    print '(a)', 'usage: kmoe-fortran-example <deck.toml>'
    stop 2
  end if
  call get_command_argument(1, deck)
  call check(kmoe_initialize(), 'kmoe_initialize')
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  call check(kmoe_layer_create_from_deck(layer, deck, MPI_COMM_WORLD), 'kmoe_layer_create_from_deck')
  call check(kmoe_layer_shape(layer, d, experts, top_k, dtype, tokens), 'kmoe_layer_shape')
  if (dtype /= kmoe_fp32) then
    if (rank == 0) print '(a)', 'kmoe-fortran-example: this example runs fp32 decks'
    stop 2
  end if
  allocate(hidden(d, tokens), out(d, tokens))
  call check(kmoe_layer_deck_rows(layer, 0, hidden), 'kmoe_layer_deck_rows')
  call check(kmoe_layer_forward(layer, hidden, out), 'kmoe_layer_forward')
  call check(kmoe_layer_digest(layer, out, digest), 'kmoe_layer_digest')
  if (rank == 0) print '(a,i0,a,i0,a,i0,a,i0,a,a)', 'kmoe-fortran-example: d=', d, ' tokens_per_rank=', tokens, &
                                                   ' experts=', experts, ' top_k=', top_k, ' output_digest=', digest
  call check(kmoe_layer_destroy(layer), 'kmoe_layer_destroy')
  deallocate(hidden, out)
  call check(kmoe_finalize(), 'kmoe_finalize')

contains

  subroutine check(st, what)
    integer(c_int), intent(in) :: st
    character(len=*), intent(in) :: what
    if (st /= kmoe_success) then
      print '(a,a,i0,a,a)', what, ' failed with status ', st, ': ', kmoe_last_error()
      error stop 1
    end if
  end subroutine check

end program kmoe_fortran_example
