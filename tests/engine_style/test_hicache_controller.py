"""The HiCache controller's write-back and load paths, tested as SGLang tests its memory pools
(unittest classes with setUp and tearDown, runnable alone with ``python test_hicache_controller.py``).
The scheduler's loop is the test's: it polls ``writing_check`` / ``loading_check`` as the
scheduler does between forwards, and reads the device KV only once the load is reported."""

import time
import unittest

import torch

from hicache_controller import (IO_BACKEND, HiCacheController, MHATokenToKVPool, MHATokenToKVPoolHost,
                                TokenToKVPoolAllocator)


def poll(check, expected, timeout=10.0):
    """What ``check()`` reported, polled until it reports ``expected`` or ``timeout`` passes."""
    reported = []
    deadline = time.time() + timeout
    while time.time() < deadline and sorted(reported) != sorted(expected):
        reported += check()
        time.sleep(0.001)
    return reported


class TestHiCacheController(unittest.TestCase):
    DTYPE = torch.bfloat16
    PAGE_SIZE = 4
    LAYER_NUM = 2

    def setUp(self):
        if not torch.cuda.is_available():
            self.skipTest("needs CUDA: a GPU, or --kvz-sanitize --kvz-sanitize-backend sim")
        if IO_BACKEND == "kernel" and not hasattr(torch.ops.sgl_kernel, "transfer_kv_per_layer"):
            self.skipTest("HICACHE_IO_BACKEND=kernel needs sgl_kernel, or a tool standing its ops in")
        torch.manual_seed(0)
        self.device_pool = MHATokenToKVPool(size=64, dtype=self.DTYPE, head_num=2, head_dim=8,
                                            layer_num=self.LAYER_NUM, device="cuda")
        self.allocator = TokenToKVPoolAllocator(self.device_pool)
        self.host_pool = MHATokenToKVPoolHost(self.device_pool, host_size=32, page_size=self.PAGE_SIZE)
        self.forward_stream = torch.cuda.Stream()  # the overlap scheduler's forward runs apart
        self.controller = HiCacheController(self.allocator, self.host_pool, forward_stream=self.forward_stream)

    def tearDown(self):
        self.controller.shutdown()
        torch.cuda.synchronize()
        self.host_pool.close()

    def forward(self, num_tokens):
        """A forward that writes ``num_tokens`` new tokens' KV: their slots and (layer, token, ...) K, V."""
        device_indices = self.allocator.alloc(num_tokens)
        shape = (self.LAYER_NUM, num_tokens, 2, 8)
        k = torch.randn(shape, dtype=self.DTYPE, device="cuda")
        v = torch.randn(shape, dtype=self.DTYPE, device="cuda")
        for layer_id in range(self.LAYER_NUM):
            self.device_pool.k_buffer[layer_id][device_indices] = k[layer_id]
            self.device_pool.v_buffer[layer_id][device_indices] = v[layer_id]
        return device_indices, k, v

    def assert_device_kv(self, device_indices, k, v):
        for layer_id in range(self.LAYER_NUM):
            torch.testing.assert_close(self.device_pool.k_buffer[layer_id][device_indices], k[layer_id].to("cuda"))
            torch.testing.assert_close(self.device_pool.v_buffer[layer_id][device_indices], v[layer_id].to("cuda"))

    def test_write_back_copies_every_layer_to_the_host_pages(self):
        device_indices, k, v = self.forward(2 * self.PAGE_SIZE)
        host_indices = self.controller.write(device_indices, node_id=1)
        self.assertEqual(len(host_indices), 2 * self.PAGE_SIZE)
        self.assertEqual(poll(self.controller.writing_check, [1]), [1])
        host = self.host_pool.get_flat_data(host_indices)
        torch.testing.assert_close(host[0], k.cpu())
        torch.testing.assert_close(host[1], v.cpu())

    def test_written_pages_load_back_into_new_device_slots(self):
        device_indices, k, v = self.forward(2 * self.PAGE_SIZE)
        host_indices = self.controller.write(device_indices, node_id=1)
        self.assertEqual(poll(self.controller.writing_check, [1]), [1])
        self.allocator.free(device_indices)  # evicted from the device, kept on the host

        self.forward(self.PAGE_SIZE)  # another request's forward in between
        new_indices = self.controller.load(host_indices, node_id=2)
        self.controller.start_loading()
        self.assertEqual(poll(self.controller.loading_check, [2]), [2])
        self.assert_device_kv(new_indices, k, v)

    def test_two_loads_merged_into_one_operation_report_both_nodes(self):
        first, k1, v1 = self.forward(self.PAGE_SIZE)
        second, k2, v2 = self.forward(self.PAGE_SIZE)
        host1 = self.controller.write(first, node_id=1)
        host2 = self.controller.write(second, node_id=2)
        self.assertEqual(sorted(poll(self.controller.writing_check, [1, 2])), [1, 2])
        new1 = self.controller.load(host1, node_id=3)
        new2 = self.controller.load(host2, node_id=4)
        self.controller.start_loading()
        self.assertEqual(poll(self.controller.loading_check, [3, 4]), [3, 4])
        self.assert_device_kv(new1, k1, v1)
        self.assert_device_kv(new2, k2, v2)

    def test_a_load_into_slots_a_finished_request_read_lands_after_its_forward(self):
        device_indices, k, v = self.forward(self.PAGE_SIZE)
        host_indices = self.controller.write(device_indices, node_id=1)
        self.assertEqual(poll(self.controller.writing_check, [1]), [1])

        finished, _, _ = self.forward(self.PAGE_SIZE)  # another request, its last forward reading its KV
        self.forward_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.forward_stream):
            self.device_pool.k_buffer[0][finished].float().sum()  # race[36738]: queued (its attention)
        self.allocator.alloc(len(self.allocator.free_slots))  # the device pool is full
        self.allocator.free(finished)  # that request finished: its slots are the free ones
        new_indices = self.controller.load(host_indices, node_id=2)
        self.assertTrue(torch.equal(new_indices, finished))
        self.controller.start_loading()
        self.assertEqual(poll(self.controller.loading_check, [2]), [2])
        self.assert_device_kv(new_indices, k, v)

    def prefetch_into_free_pages(self):
        """A prefetch from the storage tier: host pages allocated and filled by the host."""
        prefetch = self.host_pool.alloc(self.PAGE_SIZE)
        shape = (self.LAYER_NUM, self.PAGE_SIZE, 2, 8)
        self.host_pool.set_from_storage(prefetch, torch.ones(shape, dtype=self.DTYPE), torch.ones(shape, dtype=self.DTYPE))
        return prefetch

    def test_host_pages_of_a_load_in_flight_are_not_evicted(self):
        device_indices, k, v = self.forward(self.PAGE_SIZE)
        host_indices = self.controller.write(device_indices, node_id=1)
        self.assertEqual(poll(self.controller.writing_check, [1]), [1])
        new_indices = self.controller.load(host_indices, node_id=2)
        self.controller.start_loading()

        # the scheduler's next iteration: check the load, then evict host pages for a prefetch
        loaded = self.controller.loading_check()
        self.host_pool.alloc(len(self.host_pool.free_slots))  # the host pool is full
        evicted = self.host_pool.evict(host_indices)
        if evicted:  # a prefetch refills the pages it frees at once
            self.assertEqual(self.host_pool.pages(self.prefetch_into_free_pages()), self.host_pool.pages(host_indices))
        self.assertEqual(evicted, loaded == [2])  # only once the load is done
        self.assertEqual(loaded + poll(self.controller.loading_check, [] if loaded else [2]), [2])
        self.assert_device_kv(new_indices, k, v)

    def test_host_pages_of_a_queued_load_stay_locked_until_it_is_checked(self):
        device_indices, k, v = self.forward(self.PAGE_SIZE)
        host_indices = self.controller.write(device_indices, node_id=1)
        self.assertEqual(poll(self.controller.writing_check, [1]), [1])
        new_indices = self.controller.load(host_indices, node_id=2)
        self.controller.start_loading()
        deadline = time.time() + 10
        while self.controller.ack_load_queue.empty() and time.time() < deadline:
            time.sleep(0.001)  # until the load thread has queued the copy (its ack is waiting)

        # host eviction under pressure before the scheduler checks the load (SGLang #27444)
        self.host_pool.alloc(len(self.host_pool.free_slots))  # the host pool is full
        evicted = self.host_pool.evict(host_indices)
        if evicted:  # a prefetch refills the pages it frees at once
            self.prefetch_into_free_pages()
        self.assertFalse(evicted)  # the load is not acked: its pages are still locked
        self.assertEqual(poll(self.controller.loading_check, [2]), [2])
        self.assert_device_kv(new_indices, k, v)

    def test_host_pages_evicted_once_loaded_are_refilled_by_a_prefetch(self):
        device_indices, k, v = self.forward(self.PAGE_SIZE)
        host_indices = self.controller.write(device_indices, node_id=1)
        self.assertEqual(poll(self.controller.writing_check, [1]), [1])
        new_indices = self.controller.load(host_indices, node_id=2)
        self.controller.start_loading()
        self.assertEqual(poll(self.controller.loading_check, [2]), [2])

        self.host_pool.alloc(len(self.host_pool.free_slots))  # the host pool fills up
        self.assertTrue(self.host_pool.evict(host_indices))
        prefetch = self.prefetch_into_free_pages()
        self.assertEqual(self.host_pool.pages(prefetch), self.host_pool.pages(host_indices))  # the same pages again
        self.assert_device_kv(new_indices, k, v)


if __name__ == "__main__":
    unittest.main()
