-- Q1, currency conversion: each bid's price from dollars to euros (89 cents a dollar).
SELECT auction, bidder, price * 89 // 100 AS price, event_time FROM bid
